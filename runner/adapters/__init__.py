"""Adapters that drive an agent framework under the runtime's guarantees (vanilla lives in ``loop``)."""
