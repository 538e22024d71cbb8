"""Step-log dashboards (docs/design.md §5.8): a run's STEPLOG and EVENTS streams, folded by one pure
`aggregate.Aggregator`, shown by three thin shells: `tail` (rich terminal table or raw JSON lines),
`exporter` (Prometheus endpoint) and `dashboard` (web page with live charts over server-sent events).
`consume` subscribes (JetStream ordered consumers, or core NATS), `httpd` is the small HTTP server
the exporter and the dashboard share."""
