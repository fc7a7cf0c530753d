"""runtime.address: which addresses are refused, and how hybrid.launch.torchrun spells out
--standalone so that torchrun's stores listen there (no processes)."""

from __future__ import annotations

import socket

import pytest

from hybrid.launch.address import check_address, numeric_address
from hybrid.launch.torchrun import _flag, _without_flag, standalone_on
from hybrid.plan import PlanError

CMD = ["-m", "hybrid.cli", "train", "--standalone"]  # the command's own arguments are left alone


def test_numeric_address_resolves_names_and_keeps_ips():
    assert numeric_address("127.0.0.2") == "127.0.0.2"
    assert numeric_address("::1") == "::1"
    assert numeric_address("localhost") in ("127.0.0.1", "::1")


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.2", "localhost"])
def test_addresses_of_this_machine_pass(address):
    check_address(address)


def test_an_address_of_another_machine_is_refused_naming_the_key():
    address = "192.0.2.1"
    try:
        with socket.socket() as s:
            s.bind((address, 0))
        pytest.skip(f"this machine has {address}")
    except OSError:
        pass
    with pytest.raises(PlanError, match=r"^runtime\.address: cannot listen on 192\.0\.2\.1 .*127\.0\.0\.1") as e:
        check_address(address)
    assert e.value.key == "runtime.address"


def test_a_name_that_does_not_resolve_is_refused_naming_the_key():
    with pytest.raises(PlanError, match=r"^runtime\.address: 'no\.such\.host\.invalid' is not an IP address"):
        check_address("no.such.host.invalid")


def test_standalone_becomes_a_c10d_rendezvous_on_the_address():
    argv = standalone_on(["--standalone", "--nproc-per-node=3", *CMD], "::1")
    head = argv[:argv.index("-m")]
    assert "--standalone" not in head and "--local-addr=::1" in head
    assert "--rdzv-backend=c10d" in head and "--rdzv-endpoint=[::1]:0" in head and "--rdzv-conf=is_host=1" in head
    assert any(a.startswith("--rdzv-id=") for a in head)
    assert argv[argv.index("-m"):] == CMD


def test_a_given_local_addr_and_rendezvous_stay():
    given = ["--nnodes=2", "--rdzv-endpoint=10.0.0.1:29400", "--local-addr", "10.0.0.2", *CMD]
    assert standalone_on(given, "10.0.0.2") == given
    assert standalone_on(["--rdzv-endpoint=h:1", *CMD], "10.0.0.2")[0] == "--local-addr=10.0.0.2"


def test_a_torchrun_flag_is_taken_out_with_its_value_before_the_command():
    """Where torchrun lacks ``--shutdown-timeout`` (torch 2.11), ``hybrid launch`` takes it out."""
    cmd = ["-m", "hybrid.cli", "train", "--shutdown-timeout", "3"]
    for spelled in (["--shutdown-timeout=5"], ["--shutdown_timeout", "5"]):
        assert _flag([*spelled, *cmd], "--shutdown-timeout") == "5"
        assert _without_flag(["--standalone", *spelled, "--nproc-per-node=3", *cmd], "--shutdown-timeout") == [
            "--standalone", "--nproc-per-node=3", *cmd]

