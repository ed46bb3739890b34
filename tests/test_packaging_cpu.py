"""pyproject.toml's package list against the tree: setuptools warns about (and a wheel leaves out) a folder that
Python can import but `packages` does not name, such as gdngen/autotune/shipped before stop 67."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _config():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_folder_of_the_package_is_listed():
    listed = set(_config()["packages"])
    folders = {".".join(d.relative_to(ROOT).parts) for d in (ROOT / "gdngen").rglob("*")
               if d.is_dir() and d.name != "__pycache__" and not d.name.startswith(".")}
    assert folders | {"gdngen"} <= listed, sorted(folders - listed)


def test_package_data_names_files_that_exist():
    for package, patterns in _config()["package-data"].items():
        folder = ROOT.joinpath(*package.split("."))
        for pattern in patterns:
            assert list(folder.glob(pattern)), (package, pattern)
