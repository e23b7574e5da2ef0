"""The dependency direction: layers 0-1 never import torch or megatron; nothing imports upward."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_flexsp"
PURE = ["megatron_flexsp", "megatron_flexsp.config", "megatron_flexsp.model_spec", "megatron_flexsp.parallelism",
        "megatron_flexsp.plan", "megatron_flexsp.topology", "megatron_flexsp.utils.logging",
        "megatron_flexsp.cost_model", "megatron_flexsp.planner", "megatron_flexsp.sim",
        "megatron_flexsp.sim.workloads", "megatron_flexsp.cli", "megatron_flexsp.planner.level",
        "megatron_flexsp.planner.bound", "megatron_flexsp.cost_model.calibrate"]
LAYER0 = {"config", "model_spec", "parallelism", "plan", "topology", "utils"}
LAYER1 = {"cost_model", "planner", "sim"}
LAYER2 = {"runtime"}
LAYER3 = {"integration"}  # with the top-level patches/ package: the only Megatron importers


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_do_not_load_torch_or_megatron(module):
    code = (f"import sys, {module}; bad = [m for m in ('torch', 'megatron') if m in sys.modules]; "
            f"assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_runtime_loads_torch_but_not_megatron_or_planner():
    code = ("import sys, megatron_flexsp.runtime.ulysses, megatron_flexsp.runtime.groups; "
            "bad = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.') "
            "or m.startswith('megatron_flexsp.planner')]; assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_no_upward_imports():
    problems = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).parts
        top = rel[0].removesuffix(".py")
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] in ("torch", "megatron") and (top in LAYER0 or top in LAYER1):
                problems.append(f"{path}: imports {name}")
            if parts[0] == "megatron_flexsp" and len(parts) > 1:
                target = parts[1]
                if top in LAYER0 and target not in LAYER0:
                    problems.append(f"{path}: layer-0 module imports {name}")
                if top in LAYER1 and target not in LAYER0 | LAYER1:
                    problems.append(f"{path}: layer-1 module imports {name}")
                if top in LAYER2 and target not in LAYER0 | LAYER2:
                    problems.append(f"{path}: the runtime imports {name} (plans arrive as values)")
            if parts[0] == "megatron" and top not in LAYER3:
                problems.append(f"{path}: imports {name}; only integration/ and patches/ may")
            if parts[0] == "megatron_flexsp" and len(parts) > 1 and parts[1] in LAYER3 \
                    and top not in LAYER3:
                problems.append(f"{path}: imports the integration layer ({name})")
    assert not problems, "\n".join(problems)


def test_no_print_in_library():
    offenders = []
    for path in list(PKG.rglob("*.py")) + list((ROOT / "patches").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                offenders.append(f"{path}:{node.lineno}")
    assert not offenders, offenders
