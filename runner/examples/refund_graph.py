"""The refund scenario as a LangGraph graph (manifests/examples/refund-langgraph.yaml).

A two-node agent: ``agent`` asks the model; ``tools`` runs each call the model asked for, one
``Send`` per call, through the runtime's journal. The factory receives the runtime's
:class:`~agentfast.runner.adapters.langgraph.GraphRuntime` and returns an uncompiled graph; the
runtime compiles it with its own checkpointer.
"""

from __future__ import annotations

from typing import Any

from langgraph.graph import START, MessagesState, StateGraph

from ..adapters.langgraph import GraphRuntime


def build(rt: GraphRuntime) -> StateGraph[MessagesState]:
    """``agent`` -> (one Send per tool call -> ``tools``) -> ``agent`` ... -> END."""
    model = rt.model.bind_tools(rt.tool_schemas)

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", rt.tool_node)  # type: ignore[arg-type]  # langgraph types a node's input as a state class; this one takes a Send's dict
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", rt.route_tools, ["tools", "__end__"])
    graph.add_edge("tools", "agent")
    return graph
