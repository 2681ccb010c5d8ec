"""Hybrid sharding's settings (zero/topology.py, zero_optimization.mics_shard_size): what is
accepted, and the errors for what cannot work. No processes; the groups themselves and training
are tested in tests/parity/test_hybrid_sharding.py."""

from __future__ import annotations

import pytest

from deepcompile.config import Config, ConfigError
from deepcompile.zero.topology import shard_size_of


def _config(**zero):
    return Config.from_dict({"zero_optimization": {"stage": 3, **zero}})


def test_the_default_shards_over_the_whole_world():
    assert _config().zero_optimization.mics_shard_size == -1
    assert shard_size_of(-1, None, 8) == 8


@pytest.mark.parametrize("config_value,argument,world,size", [(2, None, 4, 2), (-1, 2, 4, 2), (2, 2, 4, 2),
                                                              (4, None, 4, 4), (1, None, 3, 1)])
def test_the_shard_size_comes_from_the_key_or_the_argument(config_value, argument, world, size):
    assert shard_size_of(config_value, argument, world) == size


def test_a_shard_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ValueError, match="3, which does not divide the world size 4"):
        shard_size_of(-1, 3, 4)
    # The key is checked when the world is known (Config.resolve at initialize), naming the key.
    config = _config(mics_shard_size=3)
    with pytest.raises(ConfigError, match="mics_shard_size is 3, which does not divide the world size 4"):
        config.resolve(4)
    assert config.resolve(6).zero_optimization.mics_shard_size == 3


def test_the_key_and_the_argument_must_agree():
    with pytest.raises(ValueError, match="disagree"):
        shard_size_of(2, 4, 8)


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_a_shard_size_must_be_a_positive_integer_or_minus_one(value):
    with pytest.raises(ConfigError, match="mics_shard_size must be -1"):
        _config(mics_shard_size=value)
    with pytest.raises(ValueError):
        shard_size_of(-1, value, 4)


def test_hierarchical_gather_is_refused_with_the_reason():
    assert _config(mics_hierarchical_params_gather=False).zero_optimization.mics_hierarchical_params_gather is False
    with pytest.raises(ConfigError, match="two-hop .* not supported"):
        _config(mics_shard_size=2, mics_hierarchical_params_gather=True)


def test_hpz_together_with_hybrid_sharding_is_refused():
    # Hybrid sharding keeps every gather inside its shard group already: a secondary copy would only
    # cost memory. Checked once the world is known (a shard size equal to the world is plain ZeRO).
    config = _config(mics_shard_size=2, zero_hpz_partition_size=2)
    with pytest.raises(ConfigError, match=r"zero_hpz_partition_size \(2\) together with mics_shard_size \(2\)"):
        config.resolve(4)
    assert config.resolve(2).zero_optimization.zero_hpz_partition_size == 2


def test_hpz_is_read_checked_against_the_world_and_zero3_only():
    assert _config().zero_optimization.zero_hpz_partition_size == 1  # DeepSpeed's default: off
    assert _config(zero_hpz_partition_size=2).resolve(4).zero_optimization.zero_hpz_partition_size == 2
    with pytest.raises(ConfigError, match="zero_hpz_partition_size is 3, which does not divide the world size 4"):
        _config(zero_hpz_partition_size=3).resolve(4)
    with pytest.raises(ConfigError, match="only ZeRO-3 partitions them"):
        Config.from_dict({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})
    for value in (0, -1, 1.5, "2", True):
        with pytest.raises(ConfigError, match="zero_hpz_partition_size must be a positive number of ranks"):
            _config(zero_hpz_partition_size=value)
