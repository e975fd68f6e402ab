#!/usr/bin/env bash
# A throw-away CA and a server certificate for "kvstore" (and localhost), for compose and tests.
# Production: certificates from your own CA. Usage: make-test-certs.sh DIR
set -euo pipefail
dir=${1:?usage: make-test-certs.sh DIR}
mkdir -p "$dir" && cd "$dir"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 -subj "/CN=kvstore test CA" \
  -keyout ca.key -out ca.crt
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=kvstore" -keyout tls.key -out tls.csr
printf 'subjectAltName=DNS:kvstore,DNS:localhost,IP:127.0.0.1\n' > san.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -extfile san.ext -out tls.crt
rm -f tls.csr san.ext ca.srl
chmod 644 ca.crt tls.crt tls.key   # test certificates only: the container user (uid 10001) reads the key
echo "made $dir/ca.crt, $dir/tls.crt, $dir/tls.key"
