"""Every module of the package imports on its own, in a fresh interpreter: no import circle (a
circle shows up as an ImportError for whichever module of it is imported first)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import hybrid

ROOT = Path(hybrid.__file__).resolve().parent


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(ROOT)], prefix="hybrid."))


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
