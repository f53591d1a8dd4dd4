"""HTTP API: app factory, error table, routes."""
