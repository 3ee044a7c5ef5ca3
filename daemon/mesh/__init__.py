"""The mesh: links to other nodes' daemons, their keys, relayed requests and pulls of their features.

Nothing imports this package unless the daemon runs a mesh or makes its keys."""
