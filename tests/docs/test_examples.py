"""Every example in the README and docs/ runs, as written.

```python blocks of one file run in order in one namespace; ```sh blocks run with bash, failing on the
first failing command. Both run in a fresh directory on the embedded default (sqlite:///permits.db).
```toml blocks are service settings: each must load as a valid ``ServerConfig``. ```console blocks show
output or deployment-specific commands and are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks(path: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang == language]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PERMITS_DATABASE_URL"}
    env["PERMITS_OWNER"] = "docs"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.parametrize("doc", [p for p in DOCS if _blocks(p, "python")], ids=lambda p: p.name)
def test_python_examples(doc: Path, tmp_path: Path) -> None:
    script = "\n\n".join(_blocks(doc, "python"))
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{doc.name}:\n{done.stdout}\n{done.stderr}"
    for said in SAYS.get(doc.name, ()):
        assert said in done.stdout, f"{doc.name} should print {said!r}:\n{done.stdout}"


#: What an example says it shows, on a fresh database: it must show it.
SAYS = {"api.md": ("refused: ", "lease TTL kept: 30 s")}


@pytest.mark.parametrize("doc", [p for p in DOCS if _blocks(p, "sh")], ids=lambda p: p.name)
@pytest.mark.slow
def test_shell_examples(doc: Path, tmp_path: Path) -> None:
    for block in _blocks(doc, "sh"):
        if block.lstrip().startswith("./scripts/"):
            continue  # the quick-start commands themselves: CI runs scripts/test, tests/cli runs the demo
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{doc.name}:\n{block}\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("doc", [p for p in DOCS if _blocks(p, "toml")], ids=lambda p: p.name)
def test_settings_examples_load(doc: Path, tmp_path: Path) -> None:
    from permits.server.config import ServerConfig

    for i, block in enumerate(_blocks(doc, "toml")):
        path = tmp_path / f"example{i}.toml"
        path.write_text(block)
        config = ServerConfig.load(path)
        assert config.database_url and config.tokens, f"{doc.name}: example {i} loaded as {config}"


def test_the_demo_runs_and_capacity_holds(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "permits", "demo", "--workers", "4", "--hold", "0.2", "--rounds", "1"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "capacity held" in done.stdout and "4 jobs ran" in done.stdout
