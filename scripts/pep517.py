"""The build backend of the root pyproject.toml: `pip install .` in a checkout, or of the sdist.

build_wheel builds the library and the command with cargo (the `wheel` profile, paths remapped as
scripts/wheel does) and assembles the same wheel as scripts/wheel, tagged ``linux_<machine>``:
cargo links against the building machine's glibc, so the wheel is for that machine.
build_sdist packs what that build needs.
"""
import io
import os
import platform
import subprocess
import sys
import tarfile

import assemble_wheel

REPO = assemble_wheel.REPO
# What the cargo build and the wheel need: the workspace (benches/ because Cargo.toml names a
# bench), the header, the Python package, and this backend.
SDIST_FILES = [
    "Cargo.toml", "Cargo.lock", "README.md", "pyproject.toml", "src", "cdylib", "cli", "benches",
    "include", "python", "scripts/assemble_wheel.py", "scripts/pep517.py", "scripts/wheel",
]
LEFT_OUT = ("__pycache__", "build", "target")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")
    cargo_home = os.environ.get("CARGO_HOME") or os.path.expanduser("~/.cargo")
    # As scripts/wheel, but naming the source's parent, not the source: pip unpacks an sdist in a
    # fresh directory each time, and flags that change make cargo rebuild every dependency.
    remap = "--remap-path-prefix=%s=. --remap-path-prefix=%s=cargo" % (os.path.dirname(REPO), cargo_home)
    env = dict(os.environ, CARGO_TARGET_DIR=target, RUSTFLAGS=(remap + " " + os.environ.get("RUSTFLAGS", "")).strip())
    cargo = ["cargo", "build", "--locked", "--profile", "wheel", "-p", "tllm-affinity-preload", "-p", "tllm-affinity"]
    try:
        subprocess.run(cargo, cwd=REPO, env=env, check=True, stdout=sys.stderr)
    except FileNotFoundError:
        sys.exit("tllm-affinity: building from source needs cargo (https://rustup.rs) on PATH")
    tag = "linux_" + platform.machine()
    return os.path.basename(assemble_wheel.assemble(os.path.join(target, "wheel"), wheel_directory, [tag]))


def build_sdist(sdist_directory, config_settings=None):
    return os.path.basename(write_sdist(sdist_directory))


def write_sdist(out_dir):
    version = assemble_wheel.workspace_version()
    base = "tllm_affinity-%s" % version
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, base + ".tar.gz")

    def clean(info):
        name = os.path.basename(info.name)
        if name in LEFT_OUT or name.endswith((".egg-info", ".pyc")):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    with tarfile.open(out + ".part", "w:gz") as tar:
        for path in SDIST_FILES:
            tar.add(os.path.join(REPO, path), arcname=base + "/" + path, filter=clean)
        pkg_info = ("Metadata-Version: 2.1\nName: tllm-affinity\nVersion: %s\n" % version).encode()
        info = tarfile.TarInfo(base + "/PKG-INFO")
        info.size = len(pkg_info)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(pkg_info))
    os.replace(out + ".part", out)
    return os.path.abspath(out)


if __name__ == "__main__":
    # scripts/wheel --sdist
    print(write_sdist(sys.argv[1]))
