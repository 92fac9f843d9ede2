"""kvsim must import and simulate without torch or triton (laptops, CI without the extra)."""

import subprocess
import sys
import textwrap


def test_kvsim_never_imports_torch_triton_ray_kernels_calibrate_or_validate():
    code = textwrap.dedent(
        """
        import sys, importlib, pkgutil
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'triton', 'kernels', 'calibrate', 'validate', 'ray'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import kvsim
        for m in pkgutil.walk_packages(kvsim.__path__, 'kvsim.'):
            if not m.name.endswith('__main__'):
                importlib.import_module(m.name)
        from kvsim.cli import main
        assert main(['kv-size', '--json']) == 0
        print('ok')
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


# The layers of kvsim, lowest first (docs/architecture.md). A module may import its own layer and
# the layers below it, never one above: the pure core knows no clock, the cost seam no engine.
LAYERS = [
    ("errors", "units", "progress"),
    ("spec",),
    ("core",),
    ("costs",),
    ("sim",),
    ("results", "accuracy"),  # accuracy: the cited estimates a summary carries (spec only)
    ("kvsize", "render", "run", "stack", "claims"),
    ("sweep",),
    ("report",),
    ("validation", "validation_ops", "interop"),
    ("cli", "__main__", "__init__"),
]


def _layer_of(module: str) -> int:
    top = module.split(".")[1] if module.count(".") else "__init__"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS and docs/architecture.md")


def test_imports_point_one_way_and_core_has_no_clock():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "kvsim"
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        if module == "kvsim":
            module = "kvsim.__init__"
        mine = _layer_of(module)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if (
                    module.startswith(("kvsim.core", "kvsim.spec", "kvsim.costs"))
                    and name.split(".")[0] == "simpy"
                ):
                    bad.append(f"{module} imports simpy: the pure layers own no clock")
                if name.startswith("kvsim.") and _layer_of(name) > mine:
                    bad.append(f"{module} (layer {mine}) imports {name} (layer {_layer_of(name)})")
    assert not bad, "\n".join(bad)


def test_import_kvsim_is_light_and_loads_the_api_on_use():
    """``import kvsim`` reads no numpy, SimPy or YAML; the API names load on first use."""
    code = textwrap.dedent(
        """
        import sys
        import kvsim
        heavy = sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'simpy', 'yaml', 'rich'})
        assert not heavy, heavy
        assert [m for m in sys.modules if m.startswith('kvsim.')] == [], sorted(sys.modules)
        from kvsim import load_scenario, run_scenario, RunSummary, RunResult, read_summary, write_run
        from kvsim.results.record import RunSummary as R
        assert RunSummary is R and kvsim.RunSummary is R
        assert set(kvsim.__all__) <= set(dir(kvsim))
        try:
            kvsim.no_such_name
        except AttributeError as exc:
            assert 'no_such_name' in str(exc)
        else:
            raise AssertionError('kvsim.no_such_name did not raise')
        print('ok')
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
