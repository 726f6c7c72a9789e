"""noxfile.py (`make test-matrix`): its oldest set is setup.cfg's lower bounds, and its subset names real tests."""

import configparser
import importlib.util
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def noxfile():
    spec = importlib.util.spec_from_file_location("refusion_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lower_bounds() -> dict[str, Version]:
    """`name: release` for each `>=` bound of setup.cfg's install_requires and the extras the matrix installs."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = [config["options"]["install_requires"]]
    lines += [config["options.extras_require"][extra] for extra in ("train", "eval")]
    bounds = {}
    for line in "\n".join(lines).split("\n"):
        if line.strip():
            requirement = Requirement(line)
            for specifier in requirement.specifier:
                if specifier.operator == ">=":
                    bounds[canonicalize_name(requirement.name)] = Version(specifier.version)
    return bounds


def test_the_oldest_set_is_setup_cfgs_lower_bounds():
    oldest = {canonicalize_name(name): Version(release) for name, release in noxfile().OLDEST.items()}
    assert oldest == lower_bounds(), "noxfile.OLDEST and setup.cfg's lower bounds differ: the oldest set must be them"


def test_the_subset_names_existing_tests():
    module = noxfile()
    paths = module.SUBSET
    assert paths and all((ROOT / path.partition("::")[0]).exists() for path in paths), paths
