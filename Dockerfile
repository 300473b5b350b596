# The image the Helm chart runs: the operator (`kvtier-operator`) and the injected
# sidecar (`kvtier-sidecar`) share it. Non-root, no build tools left behind, and no
# test environment: testenv/ is a separate project that never enters the image.
FROM python:3.11-slim AS build
# A C compiler for the core's Cython-compiled hot modules (setup.py); only this stage has it.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvtier kvtier
COPY sidecar sidecar
COPY operator operator
COPY apps apps
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[sidecar,operator]"

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home kvtier
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "kvtier[sidecar,operator]" && rm -rf /wheels
USER 10001
ENTRYPOINT ["kvtier-operator"]
