"""Named prompt templates for `kind: "score"`: plain TOML files, no code.

A template names the event schema it expects, the default labels, and the
prompt text with `{field}` placeholders filled from the event. Built-in
templates live in `schemas/prompts/`; an operator adds more by dropping
`<name>.toml` into the directory named by `SLUICE_TEMPLATES_DIR` (a file there
overrides a built-in of the same name).
"""

from __future__ import annotations

import re
import string
import tomllib
from pathlib import Path

import msgspec
from msgspec import Struct

from schemas.events import EVENT_SCHEMAS

BUILTIN_DIR = Path(__file__).resolve().parent / "prompts"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FORMATTER = string.Formatter()


class TemplateError(ValueError):
    """A request the template cannot serve; the message names what is wrong."""


class Template(Struct, frozen=True, kw_only=True):
    name: str
    prompt: str
    labels: tuple[str, ...] = ("legit", "fraud")
    event: str | None = None  # schema the event must fit; None accepts any object
    chat: bool = True  # render through the model's chat template (system + user turn)
    system: str | None = None
    description: str = ""

    def fields(self) -> list[str]:
        return [f for _, f, _, _ in _FORMATTER.parse(self.prompt) if f]

    def render(self, event: dict) -> str:
        """The prompt text for one event, or `TemplateError` naming the missing/invalid field."""
        if self.event is not None:
            try:
                msgspec.convert(event, EVENT_SCHEMAS[self.event], strict=False)
            except msgspec.ValidationError as exc:
                raise TemplateError(f"event does not fit template `{self.name}` (schema `{self.event}`): {exc}") from None
        try:
            return self.prompt.format_map(event)
        except KeyError as exc:
            raise TemplateError(f"template `{self.name}` needs event field `{exc.args[0]}`") from None
        # TypeError: `{x:.2f}` given a list; OverflowError: given 10**400
        except (ValueError, IndexError, AttributeError, TypeError, OverflowError) as exc:
            raise TemplateError(f"template `{self.name}` cannot render this event: {exc}") from None


class Templates:
    """Looks templates up by name; files are read once and kept."""

    def __init__(self, extra_dir: str | Path | None = None):
        self.dirs = [Path(extra_dir)] if extra_dir else []
        self.dirs.append(BUILTIN_DIR)
        self._cache: dict[str, Template] = {}

    def names(self) -> list[str]:
        return sorted({p.stem for d in self.dirs if d.is_dir() for p in d.glob("*.toml")})

    def get(self, name: str) -> Template:
        if name in self._cache:
            return self._cache[name]
        if not _NAME.match(name):
            raise TemplateError(f"unknown template `{name[:80]}`; known: {', '.join(self.names())}")
        for d in self.dirs:
            path = d / f"{name}.toml"
            if path.is_file():
                self._cache[name] = template = load_file(path)
                return template
        raise TemplateError(f"unknown template `{name}`; known: {', '.join(self.names())}")


def load_file(path: Path) -> Template:
    try:
        data = tomllib.loads(path.read_text())
        template = msgspec.convert({**data, "name": path.stem}, Template)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError, OSError) as exc:
        raise TemplateError(f"template file {path} is invalid: {exc}") from None
    if template.event is not None and template.event not in EVENT_SCHEMAS:
        raise TemplateError(f"template file {path}: unknown event schema `{template.event}`; "
                            f"known: {', '.join(EVENT_SCHEMAS)}")
    if len(set(template.labels)) < 2:
        raise TemplateError(f"template file {path}: needs at least two distinct labels")
    if template.system is not None and not template.chat:
        # a plain-text prompt has no turn to put it in: it would be dropped without a word
        raise TemplateError(f"template file {path}: `system` needs `chat = true`")
    return template
