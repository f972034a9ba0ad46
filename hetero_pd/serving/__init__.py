"""Serving, by role: `api/` (the OpenAI front end), `router/`, `worker/` and `control/`
(the protocol between router and workers). Running a deployment's processes is
`hetero_pd.deploy`'s: it imports these, never the reverse."""
