#!/usr/bin/env bash
# A throw-away CA and a server certificate for "kvstore" (and localhost, and every NAME given: the
# fleet's node and gateway names), plus a fleet token, for compose and tests.
# Production: certificates from your own CA. Usage: make-test-certs.sh DIR [NAME...]
set -euo pipefail
dir=${1:?usage: make-test-certs.sh DIR [NAME...]}
shift
san="DNS:kvstore,DNS:localhost,IP:127.0.0.1"
for name in "$@"; do san="$san,DNS:$name"; done
mkdir -p "$dir" && cd "$dir"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 -subj "/CN=kvstore test CA" \
  -keyout ca.key -out ca.crt
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=kvstore" -keyout tls.key -out tls.csr
printf 'subjectAltName=%s\n' "$san" > san.ext
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -extfile san.ext -out tls.crt
rm -f tls.csr san.ext ca.srl
# The fleet's token ([fleet] token_file): nodes show it each other to copy blocks. Kept when it exists,
# so making the certificates again does not split a running fleet.
[ -e fleet-token ] || head -c 32 /dev/urandom | base64 > fleet-token
chmod 644 ca.crt tls.crt tls.key fleet-token   # test files only: the container user (uid 10001) reads them
echo "made $dir/ca.crt, $dir/tls.crt, $dir/tls.key, $dir/fleet-token"
