"""Every BLINK_* variable is validated in one place, with errors naming the variable."""

from __future__ import annotations

import pytest

from blink_horovod import config
from blink_horovod.errors import ConfigError
from blink_horovod.units import format_size, parse_size


def test_defaults() -> None:
    cfg = config.load_config({})
    assert not cfg.enable and cfg.timeout_seconds == 600 and cfg.stall_check_seconds == 60
    assert cfg.chunk_bytes is None and cfg.log_level == "warning" and cfg.gpu_sm_share is None


def test_values_parse() -> None:
    cfg = config.load_config(
        {"BLINK_ENABLE": "1", "BLINK_CHUNK_BYTES": "4M", "BLINK_LOCAL_SIZE": "2", "BLINK_TIMEOUT_SECONDS": "5",
         "BLINK_LOG_LEVEL": "DEBUG", "BLINK_TOPOLOGY": "dgx1v:0,1", "BLINK_GPU_SM_SHARE": "0.5"}
    )
    assert cfg.enable and cfg.chunk_bytes == 4 << 20 and cfg.local_size == 2 and cfg.timeout_seconds == 5.0
    assert cfg.log_level == "debug" and cfg.topology == "dgx1v:0,1" and cfg.gpu_sm_share == 0.5


@pytest.mark.parametrize(
    "name,value",
    [
        ("BLINK_ENABLE", "maybe"),
        ("BLINK_CHUNK_BYTES", "lots"),
        ("BLINK_CHUNK_BYTES", "0"),
        ("BLINK_LOCAL_SIZE", "-1"),
        ("BLINK_LOCAL_SIZE", "two"),
        ("BLINK_TIMEOUT_SECONDS", "nan"),
        ("BLINK_STALL_CHECK_SECONDS", "0"),
        ("BLINK_LOG_LEVEL", "loud"),
        ("BLINK_GPU_SM_SHARE", "0"),
        ("BLINK_GPU_SM_SHARE", "1.5"),
        ("BLINK_GPU_SM_SHARE", "half"),
    ],
)
def test_invalid_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.load_config({name: value})
    assert name in str(err.value) and value.lower() in str(err.value).lower()


def test_launcher_flags_map_onto_variables() -> None:
    assert set(config.LAUNCHER_FLAGS.values()) <= set(config.ALL_VARIABLES)


@pytest.mark.parametrize("text,n", [("8", 8), ("1K", 1024), ("64M", 64 << 20), ("1G", 1 << 30), ("2k", 2048)])
def test_sizes(text: str, n: int) -> None:
    assert parse_size(text) == n
    assert parse_size(format_size(n)) == n


def test_bad_size() -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size("1.5.5M")
