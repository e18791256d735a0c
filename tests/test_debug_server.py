"""Notebook 07's reader of torch's debug server, without a job: the pages come from
torch's own templates, served by a stdlib HTTP server. (The notebook runs the real server.)"""
import http.server
import threading

import pytest

jinja2 = pytest.importorskip("jinja2")
frontend = pytest.importorskip("torch.distributed.debug._frontend")  # torch 2.14 and later

from ddp_lab.autopsy import evidence  # noqa: E402
from ddp_lab.experiments import nb07_debug_server as debug_server  # noqa: E402

RANK0 = """Current thread 0x00007f14aeffd6c0 (most recent call first):
  <no Python frame>

Thread 0x00007f157388bb80 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/x/ddp_lab/experiments/nb07_debug_server.py", line 37 in step
  File "/x/ddp_lab/experiments/nb07_debug_server.py", line 51 in main
  File "/x/ddp_lab/experiments/nb07_debug_server.py", line 98 in <module>
"""
RANK1 = RANK0.replace("distributed_c10d.py\", line 3913 in all_reduce", "nb07_debug_server.py\", line 30 in elsewhere")


def stacks_page(*responses) -> str:
    """/stacks as torch's frontend renders it: one <h2> and <pre> per rank."""
    env = jinja2.Environment(loader=jinja2.DictLoader({"base.html": frontend.BASE_TEMPLATE,
                                                       "raw_resp.html": frontend.RAW_RESP_TEMPLATE}))
    env.globals.update(zip=zip, enumerate=enumerate, nav_links="", format_json=frontend.format_json)
    addrs = [f"http://host:{4000 + r}/handler/dump_traceback?" for r in range(len(responses))]
    return env.get_template("raw_resp.html").render(title="Stacks", addrs=addrs, resps=list(responses))


def test_ranks_of_reads_each_ranks_text_from_torchs_page():
    page = stacks_page(frontend.Response(200, RANK0), frontend.Response(503, "ConnectionError: refused"))
    ranks = debug_server.ranks_of(page)
    assert sorted(ranks) == [0, 1]
    assert ranks[0] == RANK0
    assert ranks[1].startswith("Failed to fetch: status=503") and "ConnectionError: refused" in ranks[1]
    assert [f.name for f in evidence.parse_faulthandler(ranks[0])] == ["<module>", "main", "step", "all_reduce"]


class _Pages(http.server.BaseHTTPRequestHandler):
    answers: list = []  # the /stacks pages to serve, in turn; the last one repeats

    def do_GET(self):
        body = (self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    servers = []

    def start(*pages):
        handler = type("Pages", (_Pages,), {"answers": list(pages)})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def in_elsewhere(stacks):
    return evidence.parse_faulthandler(stacks[1])[-1].name == "elsewhere"


def test_wait_for_hang_reads_until_the_page_shows_the_hang(serve):
    ok = frontend.Response(200, RANK0)
    port = serve(stacks_page(ok), stacks_page(ok, ok), stacks_page(ok, frontend.Response(200, RANK1)))
    stacks = debug_server.wait_for_hang(port, in_elsewhere, limit=60)
    assert stacks == {0: RANK0, 1: RANK1}


def test_wait_for_hang_says_why_it_gave_up(serve):
    port = serve(stacks_page(frontend.Response(200, RANK0), frontend.Response(200, RANK0)))
    with pytest.raises(TimeoutError, match=rf"port {port} did not show the hang within 1 s; its last answer: .*step"):
        debug_server.wait_for_hang(port, in_elsewhere, limit=1)
    with pytest.raises(RuntimeError, match=rf"the job ended before the debug server on port {port} showed the hang"):
        debug_server.wait_for_hang(port, in_elsewhere, running=lambda: False)
