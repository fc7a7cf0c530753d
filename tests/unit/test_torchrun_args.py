"""``python -m hybrid.launch.torchrun``'s own arguments (docs/training.md, several machines;
docs/security.md): a bad one is one ``error:`` line and exit code 2, before torchrun starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

PREFIX = "error: python -m hybrid.launch.torchrun: "
TRAIN = ["--standalone", "--nproc-per-node", "1", "-m", "hybrid.cli", "train", "--plan", "conf/plans/dlrm.yaml"]


@pytest.mark.parametrize("args,message", [
    (["--address", "192.0.2.1", *TRAIN], "--address: cannot listen on 192.0.2.1 (Cannot assign requested address): "
                                         "it is not an address of this machine"),
    (["--address"], "--address needs a value"),
    (["--names"], "--names needs a value"),
    (["--exit-barrier-timeout", "soon", *TRAIN], "--exit-barrier-timeout: got 'soon'; expected a number of seconds above 0"),
    (["--exit-barrier-timeout", "0", *TRAIN], "--exit-barrier-timeout: got '0'; expected a number of seconds above 0"),
])
def test_a_bad_wrapper_argument_is_one_line_and_exit_2(args, message):
    res = subprocess.run([sys.executable, "-m", "hybrid.launch.torchrun", *args], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith(PREFIX + message) and res.stderr.count("\n") == 1, res.stderr
    assert not res.stdout
