"""Test support for agentfast: what a test (ours, or a team's for its own tools) runs against.

- :mod:`agentfast.testing.scripted`: the scripted model, an OpenAI-compatible Chat Completions
  server over real HTTP that replays a YAML script (``spec.model.script`` names one of its
  ``scripts/``, or a file locally); it stands for a remote model in tests and the offline demo.
- :mod:`agentfast.testing.faults`: the fault points' trigger (``AGENTFAST_FAULT``), which the
  runtime loads only when that variable is set (``agentfast.runner.faults``).
- :mod:`agentfast.testing.tools` and :mod:`agentfast.testing.chaos_tools`: tools for the test and
  chaos suites (echo, explode, big outputs, a credential probe; tools whose effects a test counts
  from rows).

The wheel ships it, so ``pip install agentfast`` runs the demo and a team's tests; the production
image leaves it out (the Dockerfile's default target). The Dockerfile's ``testing`` target adds it
back for the cluster tier's e2e suite and demos (docs/architecture.md, "Test support"). The
runtime never needs it: a run on a ModelConfig endpoint imports nothing from here.
"""
