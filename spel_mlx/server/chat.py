"""Chat messages as a prompt: the model folder's Jinja chat template when it has one,
else the plain format (the shipped model is not instruction-tuned): the system text,
then one "Role: content" paragraph per message, then "Assistant:", the reply ending
where the model starts the user's next turn."""
from __future__ import annotations

import json
import os

from .protocol import ApiError

PLAIN_ROLES = {"system": None, "user": "User", "assistant": "Assistant"}
PLAIN_STOP = "\nUser:"
TEMPLATE_FILE = "chat_template.jinja"       # as transformers saves it
TOKENIZER_CONFIG = "tokenizer_config.json"  # older checkpoints keep it under "chat_template"


class TemplateError(ValueError):
    """The model folder's chat template cannot be read or compiled (names the file)."""


def plain_prompt(messages: list[tuple[str, str]]) -> str:
    parts = [text.strip() if PLAIN_ROLES[role] is None else f"{PLAIN_ROLES[role]}: {text.strip()}"
             for role, text in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


def _template_source(folder: str) -> tuple[str, str] | None:
    """(the template's text, the file it came from) in `folder`, or None."""
    path = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read(), path
        except (OSError, UnicodeDecodeError) as e:
            raise TemplateError(f"{path}: {e}") from None
    path = os.path.join(folder, TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError) as e:
        raise TemplateError(f"{path}: {e}") from None
    if isinstance(template, list):          # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is None:
        return None
    if not isinstance(template, str):
        raise TemplateError(f"{path}: chat_template must be a string")
    return template, path


class ChatFormat:
    """How a server turns messages into a prompt: `prompt(messages)` and the stop
    strings it adds (the plain format's next-turn marker; none for a template, whose
    model ends its turn with its end-of-text token)."""

    def __init__(self, template=None, source: str | None = None, eos_token: str = ""):
        self.template, self.source, self.eos_token = template, source, eos_token
        self.stop = [] if template is not None else [PLAIN_STOP]

    @classmethod
    def for_model(cls, model_source: str, tokenizer) -> "ChatFormat":
        """The template beside the model (its folder, or the folder of a single file),
        else the plain format.  A template that does not compile is a TemplateError."""
        folder = model_source if os.path.isdir(model_source) else os.path.dirname(model_source)
        found = _template_source(folder) if folder else None
        if found is None:
            return cls()
        text, path = found
        from jinja2 import TemplateError as JinjaError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            template = env.from_string(text)
        except JinjaError as e:
            raise TemplateError(f"{path}: the chat template does not compile: {e}") from None
        eot = getattr(tokenizer, "eot_id", None)
        return cls(template, path, tokenizer.id_to_piece(eot) if eot is not None else "")

    def prompt(self, messages: list[tuple[str, str]]) -> str:
        if self.template is None:
            return plain_prompt(messages)
        from jinja2 import TemplateError as JinjaError
        try:
            return self.template.render(messages=[{"role": r, "content": t} for r, t in messages],
                                        add_generation_prompt=True, bos_token="", eos_token=self.eos_token)
        except JinjaError as e:
            raise ApiError(400, f"messages: the model's chat template refused them: {e}", "messages") from None


def _raise(message):
    from jinja2 import TemplateError as JinjaError
    raise JinjaError(message)
