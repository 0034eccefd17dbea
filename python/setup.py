"""Builds the pure-Python package; the one thing pyproject.toml cannot say is the start-up hook.

``tllm_affinity.pth`` must land at the top of site-packages (Python runs a ``.pth`` file's
``import`` lines at start-up only there), so the build copies it beside the packages.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
START_UP_HOOK = "tllm_affinity.pth"


class BuildWithStartUpHook(build_py):
    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, START_UP_HOOK), os.path.join(self.build_lib, START_UP_HOOK))


setup(cmdclass={"build_py": BuildWithStartUpHook})
