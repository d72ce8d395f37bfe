"""OTLP traces into the store: OpenTelemetry spans of any language become requests and calls.

An ``ExportTraceServiceRequest`` (OTLP/HTTP protobuf or JSON, maybe gzip) is decoded with the
official ``opentelemetry-proto`` messages and mapped, column by column, straight onto the
store's Arrow tables (requests, calls, link attributes, dictionaries; loop blocks as the
agent's BLOCKER records), which ``StoreWriter.insert_tables`` commits in one transaction per
payload:

- a SERVER span is a request: ``http.route`` (else the templated ``url.path``) and the method
  are its endpoint (a CONSUMER span is a background task, named by the span); status,
  duration, error (its ``exception`` events, else an ERROR status), user and tenant from
  configurable attribute keys; service, host and version from the resource (``service.name``,
  ``host.name``, ``service.version``);
- the CLIENT spans under it (same trace; the nearest SERVER ancestor owns them) are its calls:
  ``db.system`` + ``db.query.text`` / ``db.statement`` a DB call fingerprinted by the agent's
  normaliser, with its rows (``db.response.returned_rows``) and a hash of its parameter values
  when the span shows them (redis and memcached: cache calls); HTTP client spans HTTP calls by
  host; a client span under another client span (a driver's span inside a library's) is not
  counted twice;
- ``code.*`` attributes give a call its site: one location and a one-frame stack. Spans without
  them have no site (the findings show the site as unknown, nothing is invented).

Children end before their parent, so an exporter may send a request's calls in an earlier
payload than its SERVER span: client spans whose SERVER ancestor has not arrived wait in a
bounded pool (:class:`~perfsleuth.store.otlp.spans.Pending`) for a later payload of the same
trace; a client span inside another call waits too (the service it called names it as its
parent). A payload whose commit fails gives back what it took from the pool, for the
exporter's retry.

Duplicates: a request's id is its trace id followed by its span id (48 hex digits), and the
store keeps one request per id (with its calls, links and loop blocks), so a payload sent twice
is stored once.

The modules, in the order a payload goes through them (each imports only those before it):
:mod:`~perfsleuth.store.otlp.view` is the official messages as the mapping reads them (a span's
attributes and events as their messages' bytes, each distinct attribute decoded
once); :mod:`~perfsleuth.store.otlp.payload` decodes an OTLP/HTTP body and answers it;
:mod:`~perfsleuth.store.otlp.spans` reads the spans (the wanted attributes of each), walks each
up to its request and keeps the pool of spans waiting for theirs;
:mod:`~perfsleuth.store.otlp.calls` makes a client span a call (fingerprint, site, parameters);
:mod:`~perfsleuth.store.otlp.links` holds the span ids that link services' requests and the
queries that follow them; :mod:`~perfsleuth.store.otlp.blocks` makes event-loop blocks blocker
records; :mod:`~perfsleuth.store.otlp.tables` builds the store's Arrow tables; and
:mod:`~perfsleuth.store.otlp.batch` ties them together (``to_batch``, ``insert``).
"""
