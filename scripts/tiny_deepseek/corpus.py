"""The offline training text: JSON documents and chats from the MaskBench dev schemas, and prose from
the Python standard library's docstrings, tokenized with the DeepSeek-V4 tokenizer.

Every choice is drawn from one ``random.Random(seed)``, and the inputs are read in sorted order, so a
seed gives the same token stream on every machine that has the same data and Python version.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agent_infer.model.tokenizer import Tokenizer

#: Standard-library modules whose docstrings make the prose part (pure Python, present everywhere).
PROSE_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fnmatch",
    "fractions", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html", "http.client",
    "http.cookies", "inspect", "ipaddress", "json", "locale", "logging", "mailbox", "mimetypes", "numbers",
    "operator", "optparse", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets",
    "selectors", "shlex", "shutil", "smtplib", "socketserver", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "typing", "unittest",
    "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref", "zipfile", "zoneinfo",
)  # fmt: skip

_ASKS = (
    "Reply with a JSON value that follows this schema: {schema}",
    "Return only JSON matching the schema below.\n{schema}",
    "Fill in an example document for this JSON Schema: {schema}",
)
_MAX_SCHEMA_CHARS = 700


def docstrings() -> list[str]:
    """Docstrings of the modules above and of their public classes, functions and methods, deduplicated."""
    seen: dict[str, None] = {}
    for name in PROSE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        objects: list[Any] = [module]
        for attr in sorted(vars(module)):
            if attr.startswith("_"):
                continue
            obj = getattr(module, attr)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == name:
                objects.append(obj)
                if inspect.isclass(obj):
                    objects.extend(
                        m
                        for k, m in sorted(vars(obj).items())
                        if not k.startswith("_") and inspect.isfunction(m)
                    )
        for obj in objects:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                seen.setdefault(doc.strip(), None)
    return list(seen)


def _schema_files(folder: Path) -> Iterator[dict[str, Any]]:
    for path in sorted(folder.glob("*.json")):
        yield json.loads(path.read_text(encoding="utf-8"))


def _tool_name(description: str, index: int) -> str:
    stem = description.rsplit("/", 1)[-1].removesuffix(".json")
    cleaned = "".join(c if c.isalnum() else "_" for c in stem).strip("_").lower()
    return cleaned[:40] or f"tool_{index}"


def json_samples(folder: Path, tokenizer: Tokenizer, rng: random.Random) -> list[str]:
    """Texts from each schema's valid instances: bare documents, schema-to-JSON chats, and tool calls."""
    out: list[str] = []
    for index, entry in enumerate(_schema_files(folder)):
        schema = entry.get("schema")
        instances = [t["data"] for t in entry.get("tests", ()) if t.get("valid")]
        if not isinstance(schema, dict) or not instances:
            continue
        schema_text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        for data in instances:
            indent = rng.choice((None, None, 2))
            doc = json.dumps(data, ensure_ascii=False, indent=indent)
            out.append(doc)
            if len(schema_text) <= _MAX_SCHEMA_CHARS:
                ask = rng.choice(_ASKS).format(schema=schema_text)
                messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": doc}]
                out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
            if (
                isinstance(data, dict)
                and schema.get("type") == "object"
                and len(schema_text) <= _MAX_SCHEMA_CHARS
            ):
                name = _tool_name(str(entry.get("description", "")), index)
                tool = {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": str(schema.get("description", name)),
                        "parameters": schema,
                    },
                }
                call = {
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(data, ensure_ascii=False)},
                }
                messages = [
                    {
                        "role": "user",
                        "content": rng.choice(
                            ("Call the tool.", f"Use {name} now.", "Run the right tool for this.")
                        ),
                    },
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                ]
                out.append(tokenizer.apply_chat_template(messages, tools=[tool], add_generation_prompt=False))
    return out


def token_stream(maskbench: Path, tokenizer: Tokenizer, seed: int) -> tuple[list[int], dict[str, int]]:
    """All documents, shuffled by ``seed``, tokenized and joined with the end-of-sentence token.

    Returns the ids and the number of tokens per source (``json``, ``prose``).
    """
    rng = random.Random(seed)
    eos = tokenizer.eos_token_ids[0]
    sources = {"json": json_samples(maskbench, tokenizer, rng), "prose": docstrings()}
    docs = [(kind, text) for kind, texts in sources.items() for text in texts]
    rng.shuffle(docs)
    ids: list[int] = []
    counts = dict.fromkeys(sources, 0)
    encoded = tokenizer.hf_tokenizer.encode_batch([text for _, text in docs], add_special_tokens=False)
    for (kind, _), enc in zip(docs, encoded):
        ids.extend(enc.ids)
        if not enc.ids or enc.ids[-1] != eos:  # chats already end their turn with it
            ids.append(eos)
        counts[kind] += len(enc.ids) + 1
    return ids, counts
