"""The live cache dashboard: its routes, counter history, access token and page."""
