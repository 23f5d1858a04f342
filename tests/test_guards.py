"""Config guards: every unsupported setting is refused with the setting, its value and the reason;
every bad value is one more reason (never a TypeError, ZeroDivisionError or RecursionError)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import HOSTILE_CONFIG_VALUES, hostile_model_configs

from moe_ops import RoutingShape, UnsupportedConfigError, validate_serving_config
from moe_ops.guards import HANDOFF_CONNECTORS

try:
    import transformers
except ImportError:  # the hf extra is optional
    transformers = None

MOE = dict(num_hidden_layers=4, n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1)


def test_supported_setup_returns_the_shape():
    shape = validate_serving_config(MOE)
    assert shape == RoutingShape(3, 64, 6, moe_layers=(1, 2, 3), num_model_layers=4)
    assert validate_serving_config() is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(pipeline_parallel_size=2),
            r"pipeline_parallel_size=2: pipeline parallelism > 1 is not supported",
        ),
        (
            dict(pipeline_parallel_size=0),
            r"pipeline_parallel_size must be an int >= 1 \(1: no pipeline parallelism.*got 0$",
        ),
        (dict(pipeline_parallel_size=-3), r"pipeline_parallel_size must be an int >= 1 .*got -3$"),
        (dict(pipeline_parallel_size="2"), r"pipeline_parallel_size must be an int"),
        (dict(cpu_offload_gb=4), r"cpu_offload_gb=4: CPU weight offloading is not supported"),
        (dict(cpu_offload_gb=-1), r"cpu_offload_gb must be a finite number >= 0"),
        (dict(cpu_offload_gb=math.nan), r"cpu_offload_gb must be a finite number >= 0, got nan"),
        (dict(cpu_offload_gb=math.inf), r"cpu_offload_gb must be a finite number >= 0, got inf"),
        (dict(cpu_offload_gb=True), r"cpu_offload_gb must be a finite number >= 0, got True"),
        (dict(cpu_offload_gb="0"), r"cpu_offload_gb must be a finite number >= 0, got '0'"),
        (dict(kv_connector=5), r"kv_connector must be None or the connector's name \(a str\), got 5"),
        (dict(disaggregated_prefill="false"), r"disaggregated_prefill must be True or False, got 'false'"),
        (dict(disaggregated_prefill=0), r"disaggregated_prefill must be True or False, got 0"),
        (dict(kv_connector="NixlConnector"), r"kv_connector='NixlConnector': KV caches filled from outside"),
        (dict(disaggregated_prefill=True), r"disaggregated_prefill=True: prefill on another instance"),
        (dict(routing_handoff="yes"), r"routing_handoff must be True or False, got 'yes'"),
        (
            dict(kv_connector="SharedStorageConnector", routing_handoff=True),
            r"kv_connector='SharedStorageConnector'.*this one is not known",
        ),
    ],
)
def test_each_unsupported_setting_is_named(kwargs, match):
    with pytest.raises(UnsupportedConfigError, match=match) as info:
        validate_serving_config(MOE, **kwargs)
    assert len(info.value.reasons) == 1


def test_non_moe_model_is_refused_with_the_fields_tried():
    dense = dict(num_hidden_layers=4, hidden_size=64)
    with pytest.raises(
        UnsupportedConfigError, match=r"not a mixture-of-experts model.*num_experts_per_tok=None"
    ):
        validate_serving_config(dense)
    no_moe_layer = dict(MOE, first_k_dense_replace=4)
    with pytest.raises(UnsupportedConfigError, match="no MoE layer"):
        validate_serving_config(no_moe_layer)


def test_all_problems_are_listed_at_once_and_it_is_a_value_error():
    with pytest.raises(ValueError) as info:
        validate_serving_config(
            dict(num_hidden_layers=2),
            pipeline_parallel_size=4,
            cpu_offload_gb=1.5,
            kv_connector="LMCacheConnectorV1",
            disaggregated_prefill=True,
        )
    assert isinstance(info.value, UnsupportedConfigError)
    assert len(info.value.reasons) == 5
    text = str(info.value)
    for needle in (
        "pipeline_parallel_size=4",
        "cpu_offload_gb=1.5",
        "LMCacheConnectorV1",
        "disaggregated",
        "mixture",
    ):
        assert needle in text


# ------------------------------------------------------------- the model config's bad values


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(expert_layer_period=0), "expert_layer_period must be an int >= 1, got 0"),
        (dict(interleave_moe_layer_step=0), "interleave_moe_layer_step must be an int >= 1, got 0"),
        (dict(first_k_dense_replace="1"), "first_k_dense_replace must be an int >= 0, got '1'"),
        (dict(n_routed_experts=[8, "a"]), r"n_routed_experts=\[8, 'a'\] has entries \['a'\]"),
        (dict(moe_layers=[None]), r"moe_layers must hold int layer indices, got \[None\]"),
        (dict(enable_moe_block="false"), "enable_moe_block must be True or False, got 'false'"),
        (dict(moe_layers=[1.7]), r"moe_layers must hold int layer indices, got \[1.7\]"),
        (dict(moe_layer_freq=0), "moe_layer_freq must be an int >= 1, got 0"),
        (dict(num_hidden_layers=2**40), "num_hidden_layers=1099511627776|exceeds MAX_MODEL_LAYERS"),
        # any int is an end index (negative: the last layer): the message says that, not a bound
        (
            dict(moe_layer_end_index=1.5),
            r"moe_layer_end_index must be an int \(a layer index; negative: the last layer\), got 1.5",
        ),
        (dict(moe_layer_end_index="-1"), r"moe_layer_end_index must be an int \(a layer index.*got '-1'"),
    ],
)
def test_each_bad_model_field_is_an_unsupported_config_naming_it(fields, match):
    with pytest.raises(UnsupportedConfigError, match=match) as info:
        validate_serving_config({**MOE, **fields})
    assert len(info.value.reasons) == 1


def test_a_text_config_cycle_is_an_unsupported_config():
    outer: dict = {"text_config": dict(MOE)}
    outer["text_config"]["text_config"] = outer
    with pytest.raises(UnsupportedConfigError, match="text_config forms a cycle"):
        validate_serving_config(outer)


@settings(max_examples=400)
@given(
    config=hostile_model_configs(),
    offload=st.sampled_from(HOSTILE_CONFIG_VALUES),
    flag=st.sampled_from(HOSTILE_CONFIG_VALUES),
    method=st.sampled_from([None, "ngram", "mtp", "eagle", 5, "deepseek_mtp", "bogus"]),
)
def test_hostile_arguments_give_unsupported_config_errors_only(config, offload, flag, method):
    try:
        shape = validate_serving_config(
            config, cpu_offload_gb=offload, disaggregated_prefill=flag, speculative_method=method
        )
    except UnsupportedConfigError as e:
        assert e.reasons and all(isinstance(r, str) and r for r in e.reasons)
        return
    assert isinstance(shape, RoutingShape)
    assert offload == 0 and flag is False and method in (None, "ngram")


# ---------------------------------------------------------------- speculative decoding


DEEPSEEK_LIKE = dict(MOE, num_nextn_predict_layers=1)


@pytest.mark.parametrize("method", ["ngram", "NGRAM", "suffix", "lookahead", "medusa", "mlp_speculator"])
def test_draft_free_methods_and_mlp_heads_are_served(method):
    # the target model computes every row; RoutingLedger.reject drops the rejected drafts
    assert validate_serving_config(DEEPSEEK_LIKE, speculative_method=method).num_layers == 3


@pytest.mark.parametrize("method", ["mtp", "deepseek_mtp", "qwen3_next_mtp", "NEXTN"])
def test_mtp_layers_are_refused_saying_why(method):
    with pytest.raises(UnsupportedConfigError, match=f"speculative_method={method!r}") as info:
        validate_serving_config(DEEPSEEK_LIKE, speculative_method=method)
    (reason,) = info.value.reasons
    assert "num_nextn_predict_layers=1" in reason and "not part of the routing layer axis" in reason
    assert "model layers 0..3" in reason and "ngram" in reason
    # the same checkpoint without speculative decoding is served: its MTP layer never runs
    assert validate_serving_config(DEEPSEEK_LIKE) is not None


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(mtp_num_hidden_layers=1), "mtp_num_hidden_layers=1"),  # Qwen3-Next / Qwen3.5
        (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers=2"),
        (dict(num_mtp_layers=1), "num_mtp_layers=1"),
        # Nemotron-H: an MTP block of attention + MoE
        (dict(num_nextn_predict_layers=1, mtp_layers_block_type=["attention", "moe"]), "MoE routers"),
        ({}, "announces none"),
        (dict(num_nextn_predict_layers=0), "announces none"),
        (dict(num_nextn_predict_layers="1"), "num_nextn_predict_layers must be an int >= 0"),
    ],
)
def test_mtp_fields_the_guard_reads(fields, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        validate_serving_config({**MOE, **fields}, speculative_method="mtp")


def test_mtp_layers_declared_dense_are_served():
    dense_mtp = dict(MOE, num_nextn_predict_layers=1, mtp_layers_block_type=["attention", "mlp"])
    assert validate_serving_config(dense_mtp, speculative_method="mtp") is not None
    dense_mtp = dict(MOE, num_mtp_layers=1, mtp_mlp_layer_types=["dense"])
    assert validate_serving_config(dense_mtp, speculative_method="mtp") is not None
    with pytest.raises(UnsupportedConfigError, match="pass model_config"):
        validate_serving_config(speculative_method="mtp")


def test_draft_models_need_their_config_and_must_be_dense():
    dense_draft = dict(num_hidden_layers=1, hidden_size=64)
    moe_draft = dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    assert validate_serving_config(MOE, speculative_method="eagle3", draft_model_config=dense_draft)
    with pytest.raises(UnsupportedConfigError, match="pass draft_model_config"):
        validate_serving_config(MOE, speculative_method="eagle")
    with pytest.raises(UnsupportedConfigError, match="the draft model has 2 MoE layers") as info:
        validate_serving_config(MOE, speculative_method="draft_model", draft_model_config=moe_draft)
    assert "not part of the target model's routing layer axis" in info.value.reasons[0]
    with pytest.raises(UnsupportedConfigError, match="has router fields but cannot be resolved"):
        validate_serving_config(
            MOE, speculative_method="standalone", draft_model_config=dict(moe_draft, num_experts_per_tok=0)
        )


class _Path:  # os.PathLike: a checkpoint folder, not a config
    def __fspath__(self):
        return "/ckpt/moe-draft"


@pytest.mark.parametrize(
    "draft, match",
    [
        ("org/moe-draft", r"got 'org/moe-draft': a name or path says nothing about its routers"),
        (b"org/moe-draft", "a name or path says nothing about its routers"),
        (_Path(), "a name or path says nothing about its routers"),
        (42, "got a int: 42"),
        (1.5, "got a float: 1.5"),
        (True, "got a bool: True"),
        ([{"num_hidden_layers": 1}], "got a list"),
        ((1, 2), "got a tuple"),
        ({}, r"num_hidden_layers an int >= 1, got num_hidden_layers=None in \{\}"),
        ({"hidden_size": 64}, "num_hidden_layers=None"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers='2'"),
        ({"num_hidden_layers": True}, "num_hidden_layers=True"),
        (object(), "num_hidden_layers=None"),
    ],
)
def test_a_draft_config_the_guard_cannot_read_is_refused_not_taken_for_dense(draft, match):
    """Dense only when the config is readable (a decoder config: num_hidden_layers >= 1) and has no
    router fields; a model's name, a number, a list or an empty dict says nothing of its routers."""
    with pytest.raises(UnsupportedConfigError, match=match) as info:
        validate_serving_config(MOE, speculative_method="eagle", draft_model_config=draft)
    assert len(info.value.reasons) == 1 and info.value.reasons[0].startswith("draft_model_config ")


@settings(max_examples=200)
@given(
    draft=st.one_of(
        st.sampled_from(HOSTILE_CONFIG_VALUES),
        st.fixed_dictionaries({"num_hidden_layers": st.sampled_from(HOSTILE_CONFIG_VALUES)}),
        st.fixed_dictionaries(
            {
                "text_config": st.fixed_dictionaries(
                    {"num_hidden_layers": st.sampled_from(HOSTILE_CONFIG_VALUES)}
                )
            }
        ),
    )
)
def test_a_router_free_draft_is_served_only_with_a_layer_count(draft):
    layers = None
    if isinstance(draft, dict):
        layers = draft.get("text_config", draft).get("num_hidden_layers")
    readable = type(layers) is int and layers >= 1
    try:
        shape = validate_serving_config(MOE, speculative_method="eagle3", draft_model_config=draft)
    except UnsupportedConfigError as e:
        assert not readable, e.reasons
        assert len(e.reasons) == 1 and "draft_model_config" in e.reasons[0]
    else:
        assert readable and shape == validate_serving_config(MOE)


class _RaisingConfig:
    """A config object whose get_text_config raises (a transformers config with a broken
    sub-config does): the guard reports it, it does not let the error through."""

    num_hidden_layers = 2

    def get_text_config(self, decoder=False):
        raise RuntimeError("sub-config 'text_config' failed to load")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(model_config=_RaisingConfig()), "model_config cannot be read: RuntimeError: sub-config"),
        (
            dict(model_config=_RaisingConfig(), speculative_method="deepseek_mtp"),
            "model_config cannot be read: RuntimeError: sub-config",
        ),
        (
            dict(model_config=MOE, speculative_method="eagle", draft_model_config=_RaisingConfig()),
            "draft_model_config cannot be read: RuntimeError: sub-config",
        ),
    ],
)
def test_a_config_whose_own_code_raises_is_an_unsupported_config(kwargs, match):
    with pytest.raises(UnsupportedConfigError, match=match) as info:
        validate_serving_config(**kwargs)
    assert len(info.value.reasons) == 1


@pytest.mark.skipif(transformers is None, reason="transformers is not installed (the hf extra)")
def test_transformers_draft_configs_dense_served_moe_refused():
    """Real config objects: a one-layer Llama (an EAGLE head's config) is a dense draft; a
    Qwen3-MoE draft has routers of its own."""
    dense = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128)
    assert validate_serving_config(MOE, speculative_method="eagle", draft_model_config=dense)
    moe = transformers.Qwen3MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    with pytest.raises(UnsupportedConfigError, match="the draft model has 2 MoE layers"):
        validate_serving_config(MOE, speculative_method="eagle", draft_model_config=moe)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(speculative_method="bogus"), "speculative_method='bogus' is not a method the guard knows"),
        (dict(speculative_method=5), r"speculative_method must be None or the method's name \(a str\)"),
        (dict(draft_model_config={"num_hidden_layers": 1}), "speculative_method is None"),
        (
            dict(speculative_method="ngram", draft_model_config={"num_hidden_layers": 1}),
            "runs no separate draft model",
        ),
    ],
)
def test_inconsistent_speculative_arguments_are_refused(kwargs, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        validate_serving_config(MOE, **kwargs)


@pytest.mark.skipif(transformers is None, reason="transformers is not installed (the hf extra)")
def test_deepseek_v3_config_object_with_its_mtp_layer():
    """transformers' DeepseekV3Config ships one MTP layer (num_nextn_predict_layers, num_mtp_layers;
    5.17 and 5.24 have them, 5.13 neither): served without speculative decoding, refused with MTP
    drafting, saying which layers where the config names them and that it names none otherwise."""
    config = transformers.DeepseekV3Config()
    assert validate_serving_config(config).num_layers == 58
    assert validate_serving_config(config, speculative_method="ngram").num_layers == 58
    announced = getattr(config, "num_nextn_predict_layers", None)
    match = r"num_nextn_predict_layers=1.*model layers 0\.\.60" if announced else "the config announces none"
    with pytest.raises(UnsupportedConfigError, match=match):
        validate_serving_config(config, speculative_method="deepseek_mtp")


@pytest.mark.parametrize("connector", [*sorted(HANDOFF_CONNECTORS), None])
def test_disaggregated_prefill_is_served_with_the_handoff(connector):
    """With routing_handoff=True (the engine carries RoutingLedger.export_handoff's record beside the
    KV and the decode instance imports it): disaggregated prefill and the KV-transfer connectors are
    served; without it, both are refused saying what to do."""
    shape = validate_serving_config(
        MOE, kv_connector=connector, disaggregated_prefill=True, routing_handoff=True
    )
    assert shape is not None
    with pytest.raises(UnsupportedConfigError, match="routing_handoff=True") as info:
        validate_serving_config(MOE, kv_connector=connector, disaggregated_prefill=True)
    assert len(info.value.reasons) == (2 if connector else 1)
