"""Config guards: every unsupported setting is refused with the setting, its value and the reason."""

from __future__ import annotations

import pytest

from moe_ops import RoutingShape, UnsupportedConfigError, validate_serving_config

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
        (dict(pipeline_parallel_size=0), r"pipeline_parallel_size=0"),
        (dict(pipeline_parallel_size="2"), r"pipeline_parallel_size must be an int"),
        (dict(cpu_offload_gb=4), r"cpu_offload_gb=4: CPU weight offloading is not supported"),
        (dict(cpu_offload_gb=-1), r"cpu_offload_gb must be a number >= 0"),
        (dict(kv_connector="NixlConnector"), r"kv_connector='NixlConnector': KV caches filled from outside"),
        (dict(disaggregated_prefill=True), r"disaggregated_prefill=True: prefill on another instance"),
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
