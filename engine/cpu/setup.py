"""Ships `isogate_engine_cpu_torchvision.pth` into site-packages next to the packages.

A .pth file is the only way to run code before an arbitrary `import torchvision`; see
isogate_engine_cpu/torchvision_ops.py for what it does and why.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "isogate_engine_cpu_torchvision.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        source = Path(__file__).parent / "src" / PTH_NAME
        self.copy_file(str(source), str(Path(self.build_lib) / PTH_NAME))


setup(cmdclass={"build_py": BuildPyWithPth})
