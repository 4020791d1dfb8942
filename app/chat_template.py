"""The server's view of chat templates: model/chat_template.py (where training/ can use it too, imports
pointing down) holds the renderer, the defaults and the loading; app/ keeps importing them from here."""

from model.chat_template import (  # noqa: F401  (re-exported)
    DEFAULT_STOP,
    DEFAULT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
)
