"""``benchmarks.run --network``: the spec's parsing and the refusals that need no root (the network
itself is tested in tests/distributed/test_network.py)."""

import pytest

from benchmarks import run as bench
from benchmarks.network import NetworkSpec, parse_network


def test_loopback_is_no_emulation_and_emulated_has_the_issue_defaults():
    assert parse_network("loopback") is None
    assert parse_network("emulated") == NetworkSpec(rate_bit_s=10 * 10**9, delay_s=50e-6)
    assert parse_network("emulated:rate=100mbit,delay=1ms") == NetworkSpec(rate_bit_s=10**8, delay_s=1e-3)
    assert parse_network("emulated:delay=0") == NetworkSpec(rate_bit_s=10 * 10**9, delay_s=0.0)
    assert parse_network("emulated:rate=2.5gbit") == NetworkSpec(rate_bit_s=25 * 10**8, delay_s=50e-6)


@pytest.mark.parametrize("text, words", [
    ("wan", "expected loopback or emulated"),
    ("loopback:rate=1gbit", "expected loopback or emulated"),
    ("emulated:rate=fast", "rate='fast'"),
    ("emulated:rate=10", "rate='10'"),
    ("emulated:delay=-1ms", "delay='-1ms'"),
    ("emulated:delay=5min", "delay='5min'"),
    ("emulated:jitter=1ms", "unknown option 'jitter=1ms'"),
])
def test_a_bad_spec_names_the_bad_part(text, words):
    with pytest.raises(ValueError, match=words):
        parse_network(text)


def test_a_bad_spec_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--network", "emulated:rate=fast"])
    assert e.value.code == 2
    assert "rate='fast'" in capsys.readouterr().err


def test_without_root_the_benchmark_says_so_in_one_line_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert bench.main(["--network", "emulated", "--systems", "local"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("benchmarks.run: --network emulated needs root"), err
    assert not err[-1].startswith("Traceback") and "{" not in err[-1]
