"""scripts/_env.sh picks an interpreter that can serve, on a stock Mac too (shown with fakes).

Each test copies the script into a project of its own (nothing touches the real .venv) and runs it
with a PATH of fakes (`uname`, interpreters answering the script's probe) and a few real tools.
A fake venv's python is a copy of the fake that made it and takes `-m pip ...` as done, so no test
installs anything.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("dirname", "rm", "mkdir", "touch", "cat", "cp", "chmod", "id")
STOCK_MAC = ("3", "9", "6", "arm64")  # NOTE: Xcode's /usr/bin/python3
INTEL = ("3", "13", "1", "x86_64")  # NOTE: on a Mac, an Intel build under Rosetta
GOOD = ("3", "12", "1", "arm64")

FAKE_PYTHON = """#!/bin/sh
# answers _env.sh's probe as Python {dotted} on {machine} would
echo "$0 $*" >> "{calls}"
if [ "$1" = -c ]; then echo "{line}"; exit 0; fi
if [ "$1" = -m ] && [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; exit $?; fi
exit 0
"""


class Project:
    """A copy of _env.sh in its own directory, with fakes on PATH."""

    def __init__(self, root: Path, system: str) -> None:
        self.root = root
        self.bin = root / "bin"
        self.calls = root / "calls.log"
        (root / "scripts").mkdir(parents=True)
        self.bin.mkdir()
        shutil.copy(ROOT / "scripts" / "_env.sh", root / "scripts" / "_env.sh")
        (root / "pyproject.toml").write_text('[project]\nname = "fake"\nversion = "0"\n')
        for tool in TOOLS:
            (self.bin / tool).symlink_to(shutil.which(tool) or f"/bin/{tool}")
        machine = "arm64" if system == "Darwin" else "x86_64"
        self.script(self.bin / "uname", f'[ "$1" = -m ] && echo {machine} || echo {system}\n')

    @property
    def venv(self) -> Path:
        return self.root / ".venv"

    def script(self, path: Path, body: str) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body if body.startswith("#!") else "#!/bin/sh\n" + body)
        path.chmod(0o755)
        return path

    def python(self, path: Path | str, answer: tuple[str, ...]) -> Path:
        """A fake interpreter (a name goes on the fake PATH) answering as `answer` says."""
        path = self.bin / path if isinstance(path, str) else path
        text = FAKE_PYTHON.format(
            dotted=".".join(answer[:3]), machine=answer[3], calls=self.calls, line=" ".join(answer)
        )
        return self.script(path, text)

    def source(self, **env: str) -> subprocess.CompletedProcess[str]:
        bash = shutil.which("bash") or "/bin/bash"
        return subprocess.run(
            [bash, "-c", f"source {self.root}/scripts/_env.sh"],
            env={"PATH": str(self.bin), "HOME": str(self.root), **env},
            capture_output=True,
            text=True,
            timeout=30,
        )


@pytest.fixture
def mac(tmp_path: Path) -> Project:
    return Project(tmp_path / "project", "Darwin")


@pytest.fixture
def linux(tmp_path: Path) -> Project:
    return Project(tmp_path / "project", "Linux")


@pytest.mark.timeout(60)
def test_a_stock_mac_python_is_refused_with_what_to_install(mac):
    mac.python("python3", STOCK_MAC)
    done = mac.source()
    assert done.returncode == 1, done.stderr
    assert f"{mac.bin}/python3 is Python 3.9.6 (arm64): too old" in done.stderr
    assert "brew install python@3.12" in done.stderr and "python.org" in done.stderr
    assert not mac.venv.exists()


@pytest.mark.timeout(60)
def test_an_intel_python_on_a_mac_is_refused_as_rosetta(mac):
    mac.python("python3", INTEL)
    done = mac.source()
    assert done.returncode == 1, done.stderr
    assert "Python 3.13.1 (x86_64)" in done.stderr and "Rosetta" in done.stderr
    assert "native arm64" in done.stderr and not mac.venv.exists()


@pytest.mark.timeout(60)
def test_a_fitting_interpreter_is_picked_over_a_bad_python3(mac):
    mac.python("python3", STOCK_MAC)
    mac.python("python3.13", INTEL)
    good = mac.python("python3.11", GOOD)
    done = mac.source()
    assert done.returncode == 0, done.stderr
    assert f"creating {mac.venv} with {good}" in done.stderr
    assert (mac.venv / ".mlx-engine-installed").exists()


@pytest.mark.timeout(60)
def test_a_venv_made_by_a_too_old_python_is_removed_and_rebuilt(mac):
    mac.python(mac.venv / "bin" / "python", STOCK_MAC)
    (mac.venv / "left-by-the-old-one").touch()
    good = mac.python("python3.12", GOOD)
    done = mac.source()
    assert done.returncode == 0, done.stderr
    assert f"{mac.venv}/bin/python is Python 3.9.6 (arm64): too old" in done.stderr
    assert (
        f"removing {mac.venv}" in done.stderr and f"creating {mac.venv} with {good}" in done.stderr
    )
    assert not (mac.venv / "left-by-the-old-one").exists()
    assert "3 12 1 arm64" in (mac.venv / "bin" / "python").read_text()


@pytest.mark.timeout(60)
def test_a_fitting_venv_is_kept(mac):
    mac.python(mac.venv / "bin" / "python", GOOD)
    (mac.venv / "kept").touch()
    done = mac.source()
    assert done.returncode == 0, done.stderr
    assert (mac.venv / "kept").exists() and "creating" not in done.stderr


@pytest.mark.timeout(60)
def test_python_named_by_the_user_is_the_only_one_tried(mac):
    old = mac.python(mac.root / "elsewhere" / "python3", STOCK_MAC)
    mac.python("python3.12", GOOD)
    done = mac.source(PYTHON=str(old))
    assert done.returncode == 1, done.stderr
    assert f"{old} is Python 3.9.6" in done.stderr and not mac.venv.exists()


@pytest.mark.timeout(60)
def test_on_linux_the_message_names_the_distribution_package(linux):
    linux.python("python3", ("3", "8", "10", "x86_64"))
    done = linux.source()
    assert done.returncode == 1, done.stderr
    assert "Python 3.8.10 (x86_64): too old" in done.stderr
    assert "apt install python3.11" in done.stderr and "brew" not in done.stderr


@pytest.mark.timeout(60)
def test_an_x86_64_python_is_fine_on_linux(linux):
    good = linux.python("python3", ("3", "11", "7", "x86_64"))
    done = linux.source()
    assert done.returncode == 0, done.stderr
    assert f"with {good}" in done.stderr


@pytest.mark.timeout(60)
def test_a_failed_venv_creation_is_not_left_behind(linux):
    """`python3 -m venv` failing midway (Debian without python3-venv) left a .venv/bin/python
    without pip, so every later run skipped creation and failed at pip, even after the fix."""
    # NOTE: as `python3 -m venv DIR` does without ensurepip: the interpreter is there, then it fails.
    fake = linux.python("python3", ("3", "11", "7", "x86_64"))
    text = fake.read_text().replace(
        'cp "$0" "$3/bin/python"; exit $?', 'cp "$0" "$3/bin/python"; exit 1'
    )
    linux.script(fake, text)
    done = linux.source()
    assert done.returncode != 0
    assert "could not create" in done.stderr and not linux.venv.exists()


# NOTE: GNU-only flags and bash 4 forms: macOS has BSD tools and bash 3.2
NOT_ON_A_MAC = ("sed -i ", "readlink -f", "stat -c", "date +%N", "grep -P", "cp --", "timeout ")
NOT_ON_A_MAC += ("nproc", "mapfile", "declare -A", ",,}", "^^}", "|&", "&>>")


@pytest.mark.timeout(30)
def test_the_shell_scripts_use_nothing_a_mac_lacks():
    scripts = [p for p in (ROOT / "scripts").iterdir() if p.suffix != ".py" and p.is_file()]
    assert len(scripts) >= 3, scripts
    found = [(p.name, w) for p in scripts for w in NOT_ON_A_MAC if w in p.read_text()]
    assert found == []
