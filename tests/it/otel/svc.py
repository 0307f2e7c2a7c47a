"""An ordinary Python web service instrumented with OpenTelemetry's own
packages and no lane code at all: Flask (server spans, context extracted
from traceparent and baggage), requests (context injected into outbound
calls) and threading (context carried into a thread pool). Several
instances run in one process, one per `--serve NAME:PORT` (port 0: a
free one; the ports are printed on the `ready` line).

GET / answers {"svc": NAME, "baggage": ..., "traceparent": ..., "tracestate": ...}: what the
instance received. With --next URL it first calls URL from a worker thread
of a pool and nests that answer under "next".

Spans go to --otlp (OTLP/HTTP) when given.
"""
import argparse
import concurrent.futures
import sys
import threading

import requests
from flask import Flask, jsonify, request
from opentelemetry import trace
from opentelemetry.instrumentation.flask import FlaskInstrumentor
from opentelemetry.instrumentation.requests import RequestsInstrumentor
from opentelemetry.instrumentation.threading import ThreadingInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from werkzeug.serving import make_server


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--serve", action="append", required=True)
    p.add_argument("--next")
    p.add_argument("--otlp")
    p.add_argument("--service-name", default="svc")
    a = p.parse_args()

    provider = TracerProvider(resource=Resource.create({"service.name": a.service_name}))
    if a.otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=a.otlp), schedule_delay_millis=200)
        )
    trace.set_tracer_provider(provider)
    RequestsInstrumentor().instrument()
    ThreadingInstrumentor().instrument()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)
    session = requests.Session()

    servers = []
    for spec in a.serve:
        name, port = spec.rsplit(":", 1)
        app = Flask(name)
        FlaskInstrumentor().instrument_app(app)

        def index(name=name):
            seen = {
                "svc": name,
                "baggage": request.headers.get("baggage"),
                "traceparent": request.headers.get("traceparent"),
                "tracestate": request.headers.get("tracestate"),
            }
            if a.next:
                # The call runs on a pool thread: only the threading
                # instrumentation carries the context there.
                r = pool.submit(session.get, a.next, timeout=10).result()
                seen["next"] = r.json() if r.status_code == 200 else {"status": r.status_code}
            return jsonify(seen)

        app.add_url_rule("/", "index", index)
        srv = make_server("127.0.0.1", int(port), app, threaded=True)
        servers.append((name, srv))
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    # The ports the system gave (port 0 asks for a free one).
    print("ready " + " ".join(f"{n}={s.server_port}" for n, s in servers), flush=True)
    sys.stdin.read()  # until the test closes our stdin (or dies)
    provider.shutdown()


if __name__ == "__main__":
    main()
