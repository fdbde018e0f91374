"""view stage of the comparison server: the live dashboard and the reports kept from it.

history.py (bounded heatmap and curves, fed by the session), wire.py (on the wire: GetHistory),
tree.py (rows as a module tree), model.py (the versioned view model), service.py (cached, throttled
views), web.py (the Starlette app), listener.py (uvicorn on its own thread), page.py (the HTML, live
or frozen), tables.py (CSV).  Starlette and uvicorn load only when a dashboard is served.
"""
