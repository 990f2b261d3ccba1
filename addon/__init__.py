"""Polar's capturing proxy (a mitmproxy addon); the folder is ``addon/``, the import name ``polar_proxy``.

``polar.py`` is the ``mitmdump -s`` entry script; ``addon.Polar`` the addon (options, commands,
hooks), which hands each request to the rooms: ``exchange`` (request -> upstream -> answer),
``streaming`` (relay, SSE framing, at-once answers), ``calls`` (a call's state and its record),
``side_calls``, ``control`` and ``gate`` (control API, pause gate), ``exact_history`` and
``ledger`` (``polar_exact_history``), ``intercept``, ``httputil``, ``flows`` (what a finished
call's flow keeps: metadata, comment, body) and ``contentview``;
``state`` is what they share. ``providers/`` translate wire formats, ``engines/`` read token data,
``sessions``, ``capture`` and ``upstreams`` resolve sessions, write records and pick servers.
``process.ProxyProcess`` runs the proxy as a child process. Imports nothing of Polar's but
``polar_core``.
"""
