"""Every ANYCCL_* variable is declared once in anyccl.settings, parsed one way, and a bad value
is an InvalidArgumentError that names the variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import anyccl
from anyccl import settings
from anyccl.errors import InvalidArgumentError

SRC = Path(anyccl.__file__).parent


def _sources() -> dict[Path, str]:
    return {p: p.read_text() for p in SRC.rglob("*.py") if p.name != "settings.py"}


def test_every_variable_the_code_names_is_declared_and_read_through_settings():
    named = set()
    for path, text in _sources().items():
        named |= set(re.findall(r"ANYCCL_[A-Z0-9_]+", text))
        assert not re.search(r"environ(\.get)?[\[(]\s*[\"']ANYCCL_", text), \
            f"{path.name} reads an ANYCCL_ variable around anyccl.settings"
    assert named <= set(settings.SETTINGS), named - set(settings.SETTINGS)


def test_every_declared_variable_is_used_somewhere():
    code = "\n".join(_sources().values())
    attributes = {name for name, value in vars(settings).items()
                  if isinstance(value, settings.Setting)}
    assert len(attributes) == len(settings.SETTINGS)
    unused = sorted(a for a in attributes if f"settings.{a}" not in code)
    assert not unused, f"declared but never read: {unused}"


def test_the_docs_table_lists_every_variable_with_its_default():
    table = settings.table()
    for s in settings.SETTINGS.values():
        assert f"| `{s.name}` |" in table
    assert "| `ANYCCL_SHM_STAGING_BYTES` | size (bytes) | `1M` |" in table
    assert "| `ANYCCL_IPC_CE_MB` | size (MiB) | `512M` |" in table


@pytest.mark.parametrize("name, text, expected", [
    ("ANYCCL_SHM_STAGING_BYTES", "64K", 64 << 10),
    ("ANYCCL_SHM_STAGING_BYTES", "1M", 1 << 20),
    ("ANYCCL_SHM_STAGING_BYTES", "8192", 8192),         # bare numbers: the name's unit
    ("ANYCCL_IPC_CE_MB", "512", 512 << 20),
    ("ANYCCL_IPC_CE_MB", "1G", 1 << 30),
    ("ANYCCL_IPC_HALF_MB", "64", 64 << 20),
    ("ANYCCL_IPC_HALF_MB", "1G", 1 << 30),
    ("ANYCCL_MPI_STAGING_CHUNK", "4M", 4 << 20),
    ("ANYCCL_TIMEOUT", "2.5", 2.5),
    ("ANYCCL_DEBUG", "yes", True),
    ("ANYCCL_DEBUG", "0", False),
    ("ANYCCL_SHM_CMA", "off", False),
    ("ANYCCL_IPC_BLOCKS", "64", 64),
])
def test_values_are_parsed_the_same_way_everywhere(monkeypatch, name, text, expected):
    monkeypatch.setenv(name, text)
    assert settings.SETTINGS[name].get() == expected


def test_unset_and_empty_mean_the_default(monkeypatch):
    monkeypatch.delenv("ANYCCL_TIMEOUT", raising=False)
    assert settings.TIMEOUT.get() == 600.0
    monkeypatch.setenv("ANYCCL_TIMEOUT", " ")
    assert settings.TIMEOUT.get() == 600.0


@pytest.mark.parametrize("name, text, expected", [
    ("ANYCCL_SHM_STAGING_BYTES", "lots", "a size, e.g. 64K, 16M, 1G, or a number of bytes"),
    ("ANYCCL_SHM_STAGING_BYTES", "1T", "a size"),
    ("ANYCCL_SHM_STAGING_BYTES", "100", "at least 4K bytes"),
    ("ANYCCL_IPC_CE_MB", "-1", "a size"),
    ("ANYCCL_TIMEOUT", "soon", "a number of seconds"),
    ("ANYCCL_TIMEOUT", "0", "at least 0.001 s"),
    ("ANYCCL_TIMEOUT", "nan", "a finite number"),
    ("ANYCCL_DEBUG", "maybe", "1 or 0"),
    ("ANYCCL_IPC_BLOCKS", "many", "an integer"),
    ("ANYCCL_IPC_BLOCKS", "0", "at least 1"),
])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, name, text, expected):
    monkeypatch.setenv(name, text)
    with pytest.raises(InvalidArgumentError) as info:
        settings.SETTINGS[name].get()
    message = str(info.value)
    assert message.startswith(f"environment variable {name}={text!r} is not valid; expected ")
    assert expected in message


@pytest.mark.parametrize("name, text", [("ANYCCL_TIMEOUT", "soon"), ("ANYCCL_DEBUG", "maybe"),
                                        ("ANYCCL_SHM_STAGING_BYTES", "lots"),
                                        ("ANYCCL_JOB_KEY", "not-hex")])
def test_init_refuses_a_bad_setting_before_meeting_anyone(monkeypatch, name, text):
    for var in ("RANK", "WORLD_SIZE", "ANYCCL_STORE", "MASTER_ADDR", "OMPI_COMM_WORLD_SIZE",
                "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, text)
    if name == "ANYCCL_JOB_KEY":
        monkeypatch.setenv("ANYCCL_STORE", "127.0.0.1:1")  # never reached: the key is read first
    with pytest.raises(InvalidArgumentError, match=name):
        anyccl.init()
