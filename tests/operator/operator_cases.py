"""The example policies (valid) and the invalid ones, with the message each must be
rejected with: shared by the pure model tests and the apiserver tests."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = ROOT / "examples"
INVALID_DIR = Path(__file__).resolve().parent / "invalid"
CRDS_DIR = ROOT / "crds"
EXPECT_PREFIX = "# expect: "


@dataclass(frozen=True)
class InvalidCase:
    path: Path
    expect: str

    @property
    def body(self) -> dict[str, Any]:
        return yaml.safe_load(self.path.read_text())


def example_paths() -> list[Path]:
    return sorted(EXAMPLES_DIR.glob("*.yaml"))


def invalid_cases() -> list[InvalidCase]:
    cases = []
    for path in sorted(INVALID_DIR.glob("*.yaml")):
        first = path.read_text().splitlines()[0]
        if not first.startswith(EXPECT_PREFIX):
            raise AssertionError(f"{path} must start with '{EXPECT_PREFIX}<message>'")
        cases.append(InvalidCase(path, first[len(EXPECT_PREFIX):]))
    return cases
