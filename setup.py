"""Install-time step that pyproject.toml cannot declare: the zero-code activation hook.

Everything else about the package is in pyproject.toml. ``ownership_sanitizer.pth``
must sit at the top of site-packages (Python runs .pth lines only there), and
setuptools installs only files that belong to a package, so ``build_py`` copies
the .pth into the build root, the way pytest-cov and coverage.py ship theirs.
That covers wheels and ``pip install .``. An editable install (``pip install -e .``,
PEP 660) does not copy ``build_py`` outputs, so ``editable_wheel`` also writes
the .pth into the root of the editable wheel it builds. ``pip uninstall``
removes it in both cases (it is in the wheel's RECORD). ``ownsan install-hook``
/ ``ownsan uninstall-hook`` do the same by hand, for other ways of installing.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: no PEP 660 editable installs at all
    editable_wheel = None

PTH = "ownership_sanitizer.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode: bool = True):
        return list(super().get_outputs(include_bytecode)) + [os.path.join(self.build_lib, PTH)]


cmdclass = {"build_py": BuildPyWithPth}

if editable_wheel is not None and hasattr(editable_wheel, "_install_namespaces"):

    class EditableWheelWithPth(editable_wheel):
        # The one step that writes into the editable wheel's root before it is zipped
        # (setuptools >= 64); the .pth then lands at the top of site-packages.
        def _install_namespaces(self, installation_dir, pth_prefix):
            super()._install_namespaces(installation_dir, pth_prefix)
            self.copy_file(os.path.join(HERE, PTH), os.path.join(installation_dir, PTH), preserve_mode=0)

    cmdclass["editable_wheel"] = EditableWheelWithPth

setup(cmdclass=cmdclass)
