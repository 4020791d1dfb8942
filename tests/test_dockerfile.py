"""The container image can compile its CPU decode step and keeps what it compiled (Dockerfile, docker-compose.yml):
read as text / YAML, no docker needed.

Inductor's CPU kernels (engine/compiled_decode.py, engine/compiled_attention.py) are C++ compiled at run time, so
the runtime stage needs a C++ compiler (without one GPT_COMPILE=auto stays eager: ~0.2x llama-server's speed
instead of ~0.8x), and GPT_COMPILE_CACHE must name a folder the app user can write, on a volume, so a new container
loads the compiled steps instead of compiling them again for minutes."""

import json
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "docker-compose.yml"
COMPILERS = {"g++", "build-essential", "clang"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1].rstrip() + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def runtime_stage(text: str) -> list[tuple[str, str]]:
    """The instructions of the last stage (the image that runs)."""
    ins = instructions(text)
    start = max(i for i, (word, _) in enumerate(ins) if word == "FROM")
    return ins[start + 1:]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for word, args in stage:
        if word == "ENV":
            for tok in shlex.split(args):
                key, sep, value = tok.partition("=")
                if sep:
                    env[key] = value
    return env


def volumes_of(stage: list[tuple[str, str]]) -> list[str]:
    out = []
    for word, args in stage:
        if word == "VOLUME":
            out += json.loads(args) if args.startswith("[") else args.split()
    return out


def runs(stage: list[tuple[str, str]]) -> list[str]:
    return [args for word, args in stage if word == "RUN"]


@pytest.fixture(scope="module")
def stage():
    return runtime_stage(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def compose():
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(COMPOSE.read_text())  # safe_load resolves the anchors and `<<` merges


def test_instructions_parse_continuations_and_stages():
    text = "FROM a AS x\nRUN one \\\n  # note\n  two\n# c\nFROM b\nENV A=1 \\\n    B=\"2 3\"\nVOLUME [\"/v\"]\n"
    assert instructions(text)[1] == ("RUN", "one two")
    stage = runtime_stage(text)
    assert env_of(stage) == {"A": "1", "B": "2 3"} and volumes_of(stage) == ["/v"]


def test_runtime_stage_installs_a_cxx_compiler(stage):
    installs = [r for r in runs(stage) if re.search(r"\bapt-get\s+install\b", r)]
    assert installs, "the runtime stage installs no packages: inductor's CPU kernels need a C++ compiler"
    (run,) = [r for r in installs if COMPILERS & set(re.split(r"[\s;&|]+", r))] or [None]
    assert run is not None, f"no C++ compiler ({', '.join(sorted(COMPILERS))}) installed in the runtime stage"
    assert "--no-install-recommends" in run
    assert "rm -rf /var/lib/apt/lists/*" in run, "apt lists not removed in the same RUN (a layer keeps them)"
    # installed before the switch to the unprivileged user (apt needs root)
    user_at = max(i for i, (word, _) in enumerate(stage) if word == "USER")
    assert stage.index(("RUN", run)) < user_at


def test_compile_cache_is_an_app_owned_volume(stage):
    env = env_of(stage)
    cache = env.get("GPT_COMPILE_CACHE")
    assert cache and cache.startswith("/"), "GPT_COMPILE_CACHE not set to an absolute path in the runtime stage"
    assert cache in volumes_of(stage), f"{cache} is not declared a VOLUME"
    made = [r for r in runs(stage) if re.search(rf"mkdir\s+(-\S+\s+)*[^;&|]*(?<!\S){re.escape(cache)}(?!\S)", r)]
    assert made, f"{cache} is not created in the runtime stage"
    owned = [r for r in runs(stage)
             if re.search(rf"chown\s+(-\S+\s+)*(app|10001)(:(app|10001))?\s+[^;&|]*(?<!\S){re.escape(cache)}(?!\S)", r)]
    assert owned, f"{cache} is not owned by the app user (a fresh named volume there would be root's)"
    users = [args for word, args in stage if word == "USER"]
    assert users and users[-1].split(":")[0] in ("app", "10001")
    # beside the tokenizer's cache, as that one is kept
    assert env.get("TIKTOKEN_CACHE_DIR") in volumes_of(stage)


def _app_services(compose: dict) -> dict[str, dict]:
    """Every service that runs this image (built from this repository)."""
    return {name: svc for name, svc in compose["services"].items()
            if "build" in svc or str(svc.get("image", "")).startswith("gpt-serve")}


def test_compose_mounts_a_named_compile_cache_volume_for_every_app_service(stage, compose):
    cache = env_of(stage)["GPT_COMPILE_CACHE"]
    services = _app_services(compose)
    assert {"app", "app-cpu", "app-1", "app-2", "app-3", "gpu-1"} <= set(services)
    named = set(compose.get("volumes") or {})
    sources = set()
    for name, svc in services.items():
        mounts = {}
        for v in svc.get("volumes", []):
            if isinstance(v, str):
                source, _, rest = v.partition(":")
                mounts[rest.split(":")[0]] = source
            else:
                mounts[v["target"]] = v.get("source")
        assert cache in mounts, f"service {name} mounts nothing at {cache}"
        assert mounts[cache] in named, f"service {name}: {mounts[cache]!r} at {cache} is not a named volume"
        env = svc.get("environment") or {}
        assert env.get("GPT_COMPILE_CACHE", cache) == cache, f"service {name} points GPT_COMPILE_CACHE elsewhere"
        sources.add(mounts[cache])
    assert len(sources) == 1, f"the app services use different compile caches: {sorted(sources)}"
