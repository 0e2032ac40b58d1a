"""A live web page of a swarm: a collector that reads the peers' status records from the DHT,
and an HTTP server that serves the page and pushes snapshots to it (server-sent events)."""
