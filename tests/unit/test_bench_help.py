"""Each benchmark's ``--help`` states every option's default once: the workload's flags and the
options whose default defers to hybrid's RuntimeOptions are written once, not twice."""

import re

import pytest

from benchmarks import kernels, memory, run, scale


@pytest.mark.parametrize("module", [run, kernels, memory, scale], ids=lambda m: m.__name__)
def test_every_option_states_its_default_once(module, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per option's help
    with pytest.raises(SystemExit) as e:
        module.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    options = [o for o in re.split(r"\n  (?=-)", text.split("options:", 1)[1]) if o.strip()]
    assert len(options) > 5
    for option in options:
        assert option.count("(default:") <= 1, option
    if module is run:
        by_flag = {o.split()[0]: " ".join(o.split()) for o in options}
        assert by_flag["--tables"].endswith("(default: 8)")
        assert by_flag["--bottom-mlp"].endswith("(default: 128,32)")
        assert by_flag["--transports"].endswith("(default: RuntimeOptions')")
        assert by_flag["--network"].endswith("(default: loopback)")
