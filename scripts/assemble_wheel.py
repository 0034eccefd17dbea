"""Turns the pure python/ package into the platform wheel users install (scripts/wheel runs it).

setuptools builds the pure wheel from python/ (the same build `pip install ./python` runs, so the
package has one description); this adds the native files and retags the wheel:

* ``tllm_affinity/_lib/libtllm_affinity.so``: what ``tllm_affinity.library_path()`` names and what
  ``tllm-affinity run`` preloads;
* ``tllm_affinity/include/tllm_affinity.h``: the C header, for programs that call the library;
* ``<name>.data/scripts/tllm-affinity``: the command, which pip installs on PATH (the venv's bin/).

Entries are written in a fixed order with a fixed timestamp, so that the same inputs give the
same wheel.
"""
import argparse
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ARCHITECTURES = ("x86_64", "aarch64")


def platform_tags(arch):
    """The manylinux2014 tags of a wheel for `arch` (glibc 2.17, both spellings pip knows)."""
    return ["manylinux_2_17_" + arch, "manylinux2014_" + arch]


EPOCH = (1980, 1, 1, 0, 0, 0)


def workspace_version():
    """``[workspace.package] version`` of Cargo.toml: the project's one version."""
    with open(os.path.join(REPO, "Cargo.toml")) as f:
        section = f.read().split("[workspace.package]", 1)[1]
    return re.search(r'^version = "([^"]+)"$', section, re.M).group(1)


def python_version():
    """``__version__`` of python/tllm_affinity/__init__.py, read without importing it."""
    with open(os.path.join(REPO, "python", "tllm_affinity", "__init__.py")) as f:
        match = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M)
    return match.group(1) if match else None


def pure_wheel(work):
    """Builds python/ into a pure wheel under `work` with setuptools, as `pip install ./python`
    would (from a copy: the build leaves files behind). setuptools is called directly, not
    through pip, so that this also runs inside pip's isolated build of the sdist."""
    src = os.path.join(work, "src")
    shutil.copytree(
        os.path.join(REPO, "python"),
        src,
        ignore=lambda d, names: [n for n in names if n in ("build", "__pycache__") or n.endswith(".egg-info")],
    )
    dist = os.path.join(work, "dist")
    build = subprocess.run(
        [sys.executable, "-c", "import setuptools.build_meta as b, sys; b.build_wheel(sys.argv[1])", dist],
        cwd=src,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    if build.returncode != 0:
        sys.stderr.write(build.stdout.decode(errors="replace"))
        sys.exit("scripts/wheel: setuptools could not build python/ (it needs setuptools>=61 and wheel)")
    (name,) = [n for n in os.listdir(dist) if n.endswith(".whl")]
    return os.path.join(dist, name)


def record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (path, digest, len(data))


def assemble(native, out_dir, tags):
    """Writes the wheel into `out_dir` from cargo's output directory `native`, with the platform
    tags `tags`; returns its path."""
    version = workspace_version()
    # One version everywhere: the workspace's (Cargo.toml) is the source; the Python package
    # states it too because a pure install has no Cargo.toml to read.
    if python_version() != version:
        sys.exit(
            "scripts/wheel: python/tllm_affinity/__init__.py has __version__ = %r but Cargo.toml's "
            "workspace version is %r: make them agree" % (python_version(), version)
        )

    with tempfile.TemporaryDirectory() as work:
        pure = zipfile.ZipFile(pure_wheel(work))
        entries = {}
        dist_info = None
        for info in pure.infolist():
            top = info.filename.split("/")[0]
            if top.endswith(".dist-info"):
                dist_info = top
                if info.filename.endswith(("/WHEEL", "/RECORD")):
                    continue
            entries[info.filename] = (pure.read(info), 0o644)
        name_version = dist_info[: -len(".dist-info")]
        if not name_version.endswith("-" + version):
            sys.exit("scripts/wheel: setuptools built %s, expected version %s" % (dist_info, version))

        files = {
            "tllm_affinity/_lib/libtllm_affinity.so": (os.path.join(native, "libtllm_affinity.so"), 0o755),
            "tllm_affinity/include/tllm_affinity.h": (os.path.join(REPO, "include", "tllm_affinity.h"), 0o644),
            name_version + ".data/scripts/tllm-affinity": (os.path.join(native, "tllm-affinity"), 0o755),
        }
        for path, (source, mode) in files.items():
            with open(source, "rb") as f:
                entries[path] = (f.read(), mode)
        wheel_meta = "Wheel-Version: 1.0\nGenerator: tllm-affinity scripts/wheel\nRoot-Is-Purelib: false\n"
        wheel_meta += "".join("Tag: py3-none-%s\n" % tag for tag in tags)
        entries[dist_info + "/WHEEL"] = (wheel_meta.encode(), 0o644)

        os.makedirs(out_dir, exist_ok=True)
        out = os.path.join(out_dir, "%s-py3-none-%s.whl" % (name_version, ".".join(tags)))
        record = dist_info + "/RECORD"
        lines = []
        with zipfile.ZipFile(out + ".part", "w", zipfile.ZIP_DEFLATED) as whl:
            # dist-info last, RECORD at the very end, as the wheel format recommends.
            for path in sorted(entries, key=lambda p: (p.startswith(dist_info), p)):
                data, mode = entries[path]
                info = zipfile.ZipInfo(path, EPOCH)
                info.external_attr = (0o100000 | mode) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                whl.writestr(info, data)
                lines.append(record_line(path, data))
            lines.append(record + ",,")
            info = zipfile.ZipInfo(record, EPOCH)
            info.external_attr = 0o100644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(info, "\n".join(lines) + "\n")
        os.replace(out + ".part", out)
    return os.path.abspath(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--native", required=True, help="cargo's output directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--arch", required=True, choices=ARCHITECTURES, help="what `native` was built for")
    args = parser.parse_args()
    print(assemble(args.native, args.out, platform_tags(args.arch)))


if __name__ == "__main__":
    main()
