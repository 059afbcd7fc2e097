"""An SSE event is one line whatever the text holds: Unicode line separators, which JSON
leaves raw, are escaped so clients that split lines the Python way read the event whole."""

import json

from api_proc.responses import _sse


def test_unicode_line_breaks_stay_inside_one_event_line():
    text = "a\u2028b\x85c\u2029d é 字"
    event = _sse(json.dumps({"content": text}, ensure_ascii=False)).decode()
    lines = event.splitlines()
    assert lines == [lines[0], ""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == {"content": text}
