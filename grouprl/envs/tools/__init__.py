"""Agent tools: call parsing per format (calls, formats) and typed tool schemas (schemas)."""
