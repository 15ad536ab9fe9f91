"""blinkrun: horovodrun's arguments pass through, --blink-* become BLINK_* variables, bad values exit 2."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from blink_horovod.config import LAUNCHER_FLAGS
from blink_horovod.errors import ConfigError
from blink_horovod.launcher.blinkrun import build_command, main, split_blink_args

pytestmark = pytest.mark.timeout(120)


def test_flags_become_variables_and_the_rest_passes_through() -> None:
    argv = ["-np", "4", "--blink-timeout", "30", "-H", "localhost:2,127.0.0.1:2", "--gloo",
            "--blink-topology=cpu2", "--blink-log-level", "info", "python", "train.py", "--blink-timeout", "5"]
    env, dry, rest = split_blink_args(argv)
    assert env == {"BLINK_TIMEOUT_SECONDS": "30", "BLINK_TOPOLOGY": "cpu2", "BLINK_LOG_LEVEL": "info"}
    assert not dry
    # the training script's own arguments are left alone, even ones that look like ours
    assert rest == ["-np", "4", "-H", "localhost:2,127.0.0.1:2", "--gloo", "python", "train.py",
                    "--blink-timeout", "5"]


def test_every_launcher_flag_maps_to_its_variable() -> None:
    values = {"--blink-topology": "dgx1v", "--blink-chunk-bytes": "1M", "--blink-timeout": "9",
              "--blink-stall-check": "3", "--blink-log-level": "debug", "--blink-local-size": "2",
              "--blink-plan-cache": "/tmp/plans"}
    argv = [x for flag in LAUNCHER_FLAGS for x in (flag, values[flag])] + ["-np", "2", "python", "t.py"]
    cmd, env, added, dry = build_command(argv, base_env={})
    for flag, var in LAUNCHER_FLAGS.items():
        assert env[var] == values[flag]
    assert env["BLINK_ENABLE"] == "1" and env["TF_USE_LEGACY_KERAS"] == "1"
    assert cmd[0].endswith("horovodrun") and cmd[1:] == ["-np", "2", "python", "t.py"]


def test_tf_legacy_keras_is_kept_when_set() -> None:
    _, env, added, _ = build_command(["-np", "2", "python", "t.py"], base_env={"TF_USE_LEGACY_KERAS": "0"})
    assert env["TF_USE_LEGACY_KERAS"] == "0" and "TF_USE_LEGACY_KERAS" not in added


@pytest.mark.parametrize("argv,needle", [
    (["--blink-timeout", "-1"], "--blink-timeout"),
    (["--blink-chunk-bytes", "lots"], "--blink-chunk-bytes"),
    (["--blink-log-level", "loud"], "--blink-log-level"),
    (["--blink-topology", "no-such-machine"], "--blink-topology"),
    (["--blink-local-size", "0"], "--blink-local-size"),
])
def test_bad_values_are_refused(argv, needle) -> None:
    with pytest.raises(ConfigError, match=needle):
        build_command(argv + ["-np", "2", "python", "t.py"], base_env={})


def test_dry_run_prints_the_command(capsys) -> None:
    assert main(["--dry-run", "-np", "2", "-H", "localhost:2", "--gloo", "--blink-timeout", "7", "python",
                 "x.py"]) == 0
    out = capsys.readouterr().out.strip()
    words = shlex.split(out)
    assert words[0] == "env" and "BLINK_ENABLE=1" in words and "BLINK_TIMEOUT_SECONDS=7" in words
    i = next(i for i, w in enumerate(words) if w.endswith("horovodrun"))
    assert words[i + 1:] == ["-np", "2", "-H", "localhost:2", "--gloo", "python", "x.py"]


def test_console_script_bad_value_is_one_line_exit_2() -> None:
    p = subprocess.run([sys.executable, "-m", "blink_horovod.launcher.blinkrun", "--blink-timeout", "x", "-np",
                        "2", "python", "t.py"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "--blink-timeout" in p.stderr and "Traceback" not in p.stderr
