"""The flagship for LangGraph: the conformance suite (tests/conformance.py) on its adapter.

A real OS process runs the refund graph (manifests/examples/refund-langgraph.yaml) against real
Postgres; it is SIGKILLed mid-approval and mid-tool, and resumed in a new process from the
opaque sdk_state. Also the parallel batch: the gated refund and the non-gated note; the note
must run exactly once though LangGraph itself would re-run the batch on resume.

    pytest tests/test_flagship_kill_resume.py -q
"""

from .conformance import LANGGRAPH, ConformanceSuite


class TestLangGraphConformance(ConformanceSuite):
    ADAPTER = LANGGRAPH
