"""kvsim must import and simulate without torch or triton (laptops, CI without the extra)."""

import subprocess
import sys
import textwrap


def test_kvsim_never_imports_torch_triton_kernels_or_calibrate():
    code = textwrap.dedent(
        """
        import sys, importlib, pkgutil
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'triton', 'kernels', 'calibrate'):
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
