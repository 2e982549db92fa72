"""The slice of the TFE API v2 the Terraform CLI speaks (`backend "remote"`, `cloud`).

Served beside runplane's own API by the same process, on the same state and events:
discovery and the handshake (`discovery.py`), JSON:API documents and errors
(`jsonapi.py`), `terraform login` (`login.py`), HTTPS (`tls.py`), capability URLs for
what the CLI fetches without a token (`capability.py`), organizations, workspaces and
their locks (`workspaces.py`), and state versions (`state.py`). `routes.py` mounts them.
What the CLI sends and what each route answers: docs/tfe-api.md.
"""
