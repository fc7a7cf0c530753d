"""Every module of the package imports on its own, in a fresh interpreter: no import circle (a
circle shows up as an ImportError for whichever module of it is imported first); and the library
stands apart from its examples: no module of it imports ``recsys_examples``, or names it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hybrid

ROOT = Path(hybrid.__file__).resolve().parent


def _modules() -> list[str]:
    """Every module of the package, folders without ``__init__.py`` (namespace packages) included."""
    names = []
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def test_every_module_imports_alone():
    # One interpreter per module would take minutes (torch alone is seconds); one interpreter
    # that drops every hybrid module from sys.modules before each import is as strict.
    code = (
        "import importlib, sys, traceback\n"
        "import torch\n"
        "bad = []\n"
        "for name in sys.argv[1:]:\n"
        "    for m in [k for k in sys.modules if k == 'hybrid' or k.startswith('hybrid.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        bad.append(name + ': ' + traceback.format_exc().strip().splitlines()[-1])\n"
        "print('\\n'.join(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    modules = _modules()
    assert len(modules) > 30, modules
    res = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_library_imports_nothing_of_its_examples():
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "hybrid_cli = importlib.import_module('hybrid.cli')\n"
        "hybrid_cli.build_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'recsys_examples'))\n"
    )
    modules = _modules()
    res = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "[]", res.stdout
    named = [f"{p.relative_to(ROOT.parent)}:{n}" for p in sorted(ROOT.rglob("*")) if p.suffix in (".py", ".cpp", ".h")
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "recsys_examples" in line]
    assert named == [], named


def test_the_library_calls_no_c_function_through_ctypes():
    """Native code is the extension's typed operators (hybrid/ops/csrc): no module of the library
    loads C functions by name with untyped arguments."""
    named = [f"{p.relative_to(ROOT.parent)}:{n}" for p in sorted(ROOT.rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if "ctypes" in line]
    assert named == [], named


def test_the_launcher_imports_no_torch_before_the_plan_check():
    """``hybrid launch`` parses its command line, starts the workers' fork server and has the plan
    checked in a process forked from it before it imports torch (for torchrun): a plan, config or
    data mistake is reported without the launcher paying torch's import (seconds of CPU)."""
    code = (
        "import sys\n"
        "import hybrid.cli, hybrid.launch.address, hybrid.launch.workers\n"
        "hybrid.cli.build_parser().parse_args(['launch', '-n', '3', 'train', '--plan', 'p.yaml'])\n"
        "print(sorted(m for m in ('torch', 'numpy', 'omegaconf') if m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "[]", res.stdout
