"""Adapters only: HTTP, MCP and the command line, all generated from daemon.tools."""
