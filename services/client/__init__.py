"""`runplane` as a client of a runplane API: `login`, `logout` (services/client/login.py),
`run ...`, `workspace ...` (services/client/commands.py), over HTTP(S)
(services/client/http.py), with the user's stored tokens (services/client/credentials.py).
"""
