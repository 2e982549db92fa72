"""`runplane` as a client of a runplane API: `login`, `logout` (services/surfaces/client/login.py),
`run ...`, `workspace ...` (services/surfaces/client/commands.py), over HTTP(S)
(services/surfaces/client/http.py), with the user's stored tokens
(services/surfaces/client/credentials.py).
"""
