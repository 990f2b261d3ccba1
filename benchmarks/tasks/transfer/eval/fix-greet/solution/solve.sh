#!/usr/bin/env bash
cd /app
sed -i 's/ecko/echo/' greet.sh && bash greet.sh
