#!/usr/bin/env bash
cd /app
printf 'bread\n' >> shopping.txt
